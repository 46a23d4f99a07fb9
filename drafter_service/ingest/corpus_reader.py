"""Corpus files read as batches of documents: text files and folders, chat or plain-text JSONL, token-id JSONL."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
"""Files read as one JSON object a line; every other file is read as plain text."""

TEXT_FIELDS = ("text", "completion", "output", "response")
"""String fields taken as a document's text when no ``field`` is given (the first one present)."""

ROLE_ALIASES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                "bard": "assistant", "model": "assistant"}
"""ShareGPT and other speaker names, with the OpenAI role they stand for (either name selects a message)."""

_LOGGED_PROBLEMS = 20  # malformed lines logged one by one; the rest are only counted


@dataclass(frozen=True)
class CorpusOptions:
    """What to take from the corpus files.

    Attributes:
        field: the JSONL field holding each document (a string, a list of messages or of token ids);
            None picks one by itself (see ``documents_of``).
        roles: keep only chat messages whose role (or speaker) is one of these; None keeps every message.
        vocab_size: token ids of token-id JSONL must be below it (None: below 2^31).
        piece_bytes: text files are read in pieces of about this size (cut after a line end), each
            counted as the continuation of the one before.
        batch_chars: characters of text (or token ids) gathered into one batch.
    """

    field: str | None = None
    roles: frozenset[str] | None = None
    vocab_size: int | None = None
    piece_bytes: int = 1 << 18
    batch_chars: int = 1 << 21


@dataclass
class Document:
    """One document, or the next piece of the one before (``continues``): text, or token ids ((n,) int32)."""

    text: str | None = None
    tokens: np.ndarray | None = None
    continues: bool = False


@dataclass
class Batch:
    """Documents in reading order and the file bytes read to get them."""

    documents: list[Document] = field(default_factory=list)
    nbytes: int = 0
    chars: int = 0


def _messages(items: object, roles: frozenset[str] | None) -> list[str]:
    """Contents of OpenAI ``messages`` or ShareGPT ``conversations`` items, filtered by role."""
    if not isinstance(items, list):
        raise ValueError("messages must be a list")
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("every message must be an object")
        role = item.get("role", item.get("from", ""))
        content = item.get("content", item.get("value"))
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if content is None:
            continue
        if not isinstance(content, str) or not isinstance(role, str):
            raise ValueError("a message's role and content must be strings")
        if roles is not None and role not in roles and ROLE_ALIASES.get(role) not in roles:
            continue
        if content.strip():
            out.append(content)
    return out


def _token_ids(value: object, vocab_size: int | None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError("token ids must be a list of integers")
    limit = vocab_size if vocab_size is not None else 1 << 31
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        raise ValueError(f"token ids must be in [0, {limit})")
    return arr.astype(np.int32)


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def documents_of(obj: object, options: CorpusOptions) -> list[str | np.ndarray]:
    """The documents of one JSONL record.

    Without ``options.field``: token ids in ``prompt`` / ``output`` (lists of integers; one document,
    prompt then output, as the service stores a request), else the messages of ``messages`` (OpenAI chat)
    or ``conversations`` (ShareGPT), one document each, else the first string among ``text``,
    ``completion``, ``output``, ``response``. ``options.roles`` filters messages only.

    Raises:
        ValueError: the record is not an object or holds nothing usable.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    name = options.field
    if name is not None:
        if name not in obj:
            raise ValueError(f"no field {name!r}")
        value = obj[name]
        if isinstance(value, str):
            return [value] if value else []
        if _is_token_list(value):
            return [_token_ids(value, options.vocab_size)] if value else []
        if isinstance(value, list):
            return list(_messages(value, options.roles))
        raise ValueError(f"field {name!r} is neither a string, nor messages, nor token ids")
    ids = [obj[k] for k in ("prompt", "output") if _is_token_list(obj.get(k))]
    if ids:
        tokens = _token_ids([t for part in ids for t in part], options.vocab_size)
        return [tokens] if tokens.size else []
    for key in ("messages", "conversations"):
        if key in obj:
            return list(_messages(obj[key], options.roles))
    for key in TEXT_FIELDS:
        if isinstance(obj.get(key), str):
            return [obj[key]] if obj[key] else []
    raise ValueError("no text (text, completion, output, response, messages, conversations) "
                     "and no token ids (prompt, output)")


def corpus_files(paths: Sequence[str | pathlib.Path]) -> list[pathlib.Path]:
    """Every file named or found (recursively, in name order, hidden ones left out) under the folders named.

    Raises:
        FileNotFoundError: a path that does not exist.
    """
    files: list[pathlib.Path] = []
    for raw in paths:
        path = pathlib.Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such file or folder: {path}")
    return files


class CorpusReader:
    """Reads corpus files as batches of documents, reporting what it cannot read instead of stopping.

    Attributes:
        files: the files to read.
        total_bytes: their sizes added up.
        problems: (file, line number or 0 for a whole file, reason) of every line or file skipped.
    """

    def __init__(self, paths: Sequence[str | pathlib.Path], options: CorpusOptions | None = None) -> None:
        self.options = options or CorpusOptions()
        self.files = corpus_files(paths)
        self.total_bytes = sum(p.stat().st_size for p in self.files)
        self.problems: list[tuple[str, int, str]] = []

    def _problem(self, path: pathlib.Path, line: int, reason: str) -> None:
        self.problems.append((str(path), line, reason))
        if len(self.problems) <= _LOGGED_PROBLEMS:
            where = f"{path}, line {line}" if line else str(path)
            logger.warning("%s skipped: %s", where, reason)

    def batches(self) -> Iterator[Batch]:
        """Batches of about ``options.batch_chars`` characters, in file order."""
        batch = Batch()
        for path in self.files:
            reader = self._jsonl if path.suffix.lower() in JSONL_SUFFIXES else self._text
            for doc, nbytes in reader(path):
                batch.nbytes += nbytes
                if doc is not None:
                    batch.documents.append(doc)
                    if doc.text is not None:
                        batch.chars += len(doc.text)
                    elif doc.tokens is not None:
                        batch.chars += doc.tokens.size
                if batch.chars >= self.options.batch_chars:
                    yield batch
                    batch = Batch()
        if batch.documents or batch.nbytes:
            yield batch

    def _jsonl(self, path: pathlib.Path) -> Iterator[tuple[Document | None, int]]:
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    yield None, len(line)
                    continue
                try:
                    docs = documents_of(json.loads(line), self.options)
                except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # JSONDecodeError is a ValueError;
                    self._problem(path, line_no, str(exc))  # RecursionError: JSON nested too deeply
                    yield None, len(line)
                    continue
                yield None, len(line)
                for doc in docs:
                    yield (Document(text=doc) if isinstance(doc, str) else Document(tokens=doc)), 0

    def _text(self, path: pathlib.Path) -> Iterator[tuple[Document | None, int]]:
        """A text file as one document, read in pieces cut after a line end (or else between characters)."""
        with open(path, "rb") as f:
            if b"\0" in f.read(8192):  # whatever the piece size
                self._problem(path, 0, "binary file (it holds NUL bytes)")
                yield None, path.stat().st_size
                return
            f.seek(0)
            carry, first = b"", True
            while True:
                block = f.read(self.options.piece_bytes)
                data = carry + block
                cut = len(data) if not block else _cut(data)
                piece, carry = data[:cut], data[cut:]
                if piece:
                    yield Document(text=piece.decode("utf-8", errors="replace"), continues=not first), len(block)
                    first = False
                elif block:
                    yield None, len(block)
                if not block:
                    return


def _cut(data: bytes) -> int:
    """Where to end a piece of ``data``: after its last line end, else before a trailing partial character.

    0 when ``data`` is no more than the start of one character: the caller reads on.
    """
    cut = data.rfind(b"\n") + 1
    if cut:
        return cut
    cut = len(data)
    while cut > len(data) - 3 and cut > 0 and data[cut - 1] & 0xC0 == 0x80:  # UTF-8 continuation bytes
        cut -= 1
    if cut > 0 and data[cut - 1] >= 0xC0:  # ... and the lead byte they belong to
        cut -= 1
    return cut
