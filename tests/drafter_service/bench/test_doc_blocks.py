"""Benchmark tables written into the docs between markers, with their command, machine and date."""

from __future__ import annotations

import datetime

import pytest

from drafter_service.bench.doc_blocks import DocBlockError, block_text, parse_targets, write_block, write_doc_blocks
from drafter_service.bench.machine import machine


def test_a_block_is_replaced_and_the_rest_of_the_page_kept(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\ntext before\n<!-- bench:replay -->\nold table\n<!-- /bench:replay -->\ntext after\n")
    write_block(page, "replay", "| new | table |")
    assert page.read_text() == ("# Title\n\ntext before\n<!-- bench:replay -->\n| new | table |\n"
                                "<!-- /bench:replay -->\ntext after\n")


def test_the_block_names_its_command_machine_and_date_without_the_write_flags():
    text = block_text("| a |", ["bench", "replay", "--dataset", "mtbench", "--write-doc", "README.md:replay",
                                "--write-doc=docs/b.md:replay"], datetime.date(2026, 11, 27))
    assert text.startswith("```\ndrafter bench replay --dataset mtbench\n```")
    assert f"Machine: {machine()}; run on 2026-11-27" in text
    assert text.endswith("| a |")


@pytest.mark.parametrize("content", ["no markers\n", "<!-- bench:replay -->\n", "<!-- /bench:replay -->\n"
                                     "<!-- bench:replay -->\n", "<!-- bench:replay -->\n<!-- /bench:replay -->\n" * 2])
def test_a_page_without_exactly_one_block_is_refused_and_left_alone(tmp_path, content):
    page = tmp_path / "page.md"
    page.write_text(content)
    with pytest.raises(DocBlockError):
        write_block(page, "replay", "x")
    assert page.read_text() == content


def test_targets_are_checked_before_a_run(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- bench:e2e -->\n<!-- /bench:e2e -->\n")
    assert parse_targets([f"{page}:e2e"]) == [(page, "e2e")]
    for bad in (f"{page}", f"{page}:E2E", f"{tmp_path / 'missing.md'}:e2e", f"{page}:replay"):
        with pytest.raises(DocBlockError):
            parse_targets([bad])
    write_doc_blocks([f"{page}:e2e"], "| t |")
    assert "| t |" in page.read_text()
