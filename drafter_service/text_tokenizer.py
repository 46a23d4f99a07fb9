"""A namespace's tokenizer from local files: a tokenizer.json (or a folder holding one) and its chat template."""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Sequence

import numpy as np

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

    def __init__(self, tokenizer: object, path: str, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self._tok = tokenizer
        self.path = path
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))  # type: ignore[attr-defined]
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "TextTokenizer":
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

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, (k,) int32 each; nothing is added, special token strings map to their ids."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)  # type: ignore[attr-defined]
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def encode(self, text: str) -> np.ndarray:
        """Token ids of one text, (k,) int32."""
        return self.encode_batch([text])[0]
