"""Streaming the items of a large (possibly truncated) JSON array file."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import TextIO

logger = logging.getLogger(__name__)


def iter_json_array(f: TextIO, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Stream the items of a JSON array, stopping cleanly (with a warning) at a truncated tail.

    Args:
        f: the file, opened as text.
        chunk_chars: characters read at a time.

    Yields:
        Each complete item of the top-level array.

    Raises:
        ValueError: when the file does not start with ``[``.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof, started = "", 0, False, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos == len(buf):
            if eof:
                logger.warning("JSON array has no closing bracket; stopped at the end of the file")
                return
            buf, pos = f.read(chunk_chars), 0
            eof = not buf
            continue
        if not started:
            if buf[pos] != "[":
                raise ValueError("not a JSON array (first character is not '[')")
            started, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                logger.warning("JSON array truncated: ignored its last %d characters", len(buf) - pos)
                return
            chunk = f.read(chunk_chars)
            buf, pos, eof = buf[pos:] + chunk, 0, not chunk
            continue
        yield item
