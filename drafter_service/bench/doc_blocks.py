"""Benchmark tables written into the docs: a fresh run replaces the block its name marks in a Markdown file.

A block is the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``. What goes in is the command that
produced it, the machine, the date and the table, so a page never shows a figure without them.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from drafter_service.bench.machine import machine

__all__ = ["DocBlockError", "add_doc_flag", "block_text", "parse_targets", "write_block", "write_doc_blocks"]


class DocBlockError(ValueError):
    """A ``--write-doc`` target is malformed, or its file has no such block."""


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def write_block(path: Path, name: str, body: str) -> None:
    """Replace the content of block ``name`` in ``path`` with ``body``; the file is rewritten only when it has the
    block.

    Raises:
        DocBlockError: ``path`` lacks either marker, or holds the block twice.
    """
    text = path.read_text(encoding="utf-8")
    start, end = _markers(name)
    found = [m.start() for m in re.finditer(re.escape(start), text)]
    if len(found) != 1 or text.count(end) != 1 or text.index(end) < found[0]:
        raise DocBlockError(f"{path} must hold the block {start} ... {end} exactly once")
    head = text[:found[0] + len(start)]
    tail = text[text.index(end):]
    path.write_text(f"{head}\n{body.strip()}\n{tail}", encoding="utf-8")


def block_text(table: str, argv: Sequence[str] | None = None, when: datetime.date | None = None) -> str:
    """The command that ran (``drafter`` and ``argv``, ``--write-doc`` flags left out), the machine, the date and
    ``table``."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--write-doc":
            skip = True
        elif not a.startswith("--write-doc="):
            kept.append(a)
    day = (when or datetime.date.today()).isoformat()
    return (f"```\ndrafter {shlex.join(kept)}\n```\n\nMachine: {machine()}; run on {day} by the command above "
            f"(`make bench` reruns it and rewrites this table).\n\n{table.strip()}")


def add_doc_flag(parser: argparse.ArgumentParser) -> None:
    """``--write-doc FILE:NAME`` (repeatable) on a benchmark command."""
    parser.add_argument("--write-doc", action="append", default=[], metavar="FILE:NAME",
                        help="also write the headline table into block NAME of Markdown FILE (between "
                        "<!-- bench:NAME --> and <!-- /bench:NAME -->); repeatable")


def parse_targets(targets: Sequence[str]) -> list[tuple[Path, str]]:
    """``FILE:NAME`` targets, checked before a benchmark runs (so a typo does not waste a run).

    Raises:
        DocBlockError: a target is not ``FILE:NAME``, the file is missing, or it lacks the block.
    """
    out = []
    for target in targets:
        file, sep, name = target.rpartition(":")
        if not sep or not file or not re.fullmatch(r"[a-z0-9-]+", name):
            raise DocBlockError(f"--write-doc takes FILE:NAME (NAME of lowercase letters, digits and -), got "
                                f"{target!r}")
        path = Path(file)
        if not path.is_file():
            raise DocBlockError(f"--write-doc: no file {path}")
        start, end = _markers(name)
        text = path.read_text(encoding="utf-8")
        if text.count(start) != 1 or text.count(end) != 1:
            raise DocBlockError(f"--write-doc: {path} must hold {start} ... {end} exactly once")
        out.append((path, name))
    return out


def write_doc_blocks(targets: Sequence[str], table: str) -> None:
    """Write ``table`` (with its command, machine and date) into every ``FILE:NAME`` target."""
    body = block_text(table)
    for path, name in parse_targets(targets):
        write_block(path, name, body)
        print(f"wrote block {name} of {path}", file=sys.stderr)
