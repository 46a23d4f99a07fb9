"""A namespace's tokenizer from local files: a tokenizer.json (or a folder holding one) and its chat template."""

from __future__ import annotations

import datetime
import functools
import json
import logging
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import jinja2
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """The tokenizer files are missing or unreadable, or a text cannot be rendered with them."""


class TextTokenizer:
    """Turns log and corpus text into a namespace's token ids.

    Attributes:
        path: where it was loaded from.
        vocab_size: ids it can produce (added tokens included).
        chat_template: the Jinja chat template of the folder's tokenizer_config.json, or None.
    """

    def __init__(self, tokenizer: Tokenizer, path: str, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self._tok = tokenizer
        self.path = path
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def load(cls, path: str | pathlib.Path) -> TextTokenizer:
        """Load ``path``: a tokenizer.json file, or a folder with tokenizer.json and optionally tokenizer_config.json.

        Raises:
            TokenizerError: when no readable tokenizer.json is there.
        """
        from tokenizers import Tokenizer

        p = pathlib.Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(f"no tokenizer at {path}: give a tokenizer.json file or a folder holding one")
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise TokenizerError(f"{file} is not a readable tokenizer.json: {exc}") from None
        template, special = None, {}
        config = file.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                cfg = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config} is not readable JSON: {exc}") from None
            template = cfg.get("chat_template")
            if isinstance(template, list):  # named templates: take the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
                value = cfg.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    special[key] = value
        return cls(tok, str(path), template if isinstance(template, str) else None, special)

    def with_chat_template(self, template: str) -> TextTokenizer:
        """This tokenizer with ``template`` (Jinja text) as its chat template instead of the folder's one."""
        return TextTokenizer(self._tok, self.path, template, self.special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The text of a conversation in the chat template, as transformers' ``apply_chat_template`` renders it.

        The template runs in Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
        ``raise_exception`` and ``strftime_now`` globals, a ``tojson`` filter that keeps non-ASCII text, and the
        special tokens of tokenizer_config.json (``bos_token``, ``eos_token``, ...) as variables.

        Args:
            messages: ``{"role": ..., "content": ...}`` dictionaries, oldest first.
            add_generation_prompt: end with the template's opening of an assistant turn.

        Raises:
            TokenizerError: no chat template, or the template failed on these messages (its message says why).
        """
        if not self.chat_template:
            raise TokenizerError(f"the tokenizer at {self.path} has no chat template (no chat_template in its "
                                 "tokenizer_config.json); give one with --chat-template FILE")
        template = _compiled_template(self.chat_template)
        import jinja2

        try:
            return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the chat template failed: {exc}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:
            raise TokenizerError(f"the chat template failed on these messages: {exc!r}") from None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, (k,) int32 each; nothing is added, special token strings map to their ids."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def encode(self, text: str) -> np.ndarray:
        """Token ids of one text, (k,) int32."""
        return self.encode_batch([text])[0]


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> jinja2.Template:
    """A chat template compiled like transformers does (sandboxed, trimmed blocks, its helper functions)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the chat template does not compile: {exc}") from None
