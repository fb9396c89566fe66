"""docs/performance.md's tables are the benchmarks' own output (``benchmarks.doc_tables``):
the doc is current with the JSON it names, and the rendering keeps every number as the
run printed it."""

from __future__ import annotations

from benchmarks import doc_tables


def test_every_rendered_region_is_current_with_its_json():
    doc = doc_tables.DOC.read_text()
    assert doc.count("<!-- rendered from ") >= 8
    assert doc_tables.render(doc) == doc, "run: python -m benchmarks.doc_tables"


def test_a_printed_table_becomes_markdown_and_other_lines_stay_text():
    text = ("B9 title, ms\nprompt tokens  mode   ms p50\n        1,024  warm   +0.5\n"
            "       32,768  cold  12.250\n\nplan table per peer: 960 us\n\n"
            "odd block\na  b\n1  2  3\n")
    assert doc_tables.markdown(text) == (
        "**B9 title, ms**\n\n| prompt tokens | mode | ms p50 |\n|---:|---|---:|\n"
        "| 1,024 | warm | +0.5 |\n| 32,768 | cold | 12.250 |\n\n"
        "plan table per peer: 960 us\n\nodd block\na  b\n1  2  3\n")


def test_a_stale_region_is_found():
    doc = doc_tables.DOC.read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| 1,024 | "))
    stale = doc.replace(row, row.replace("| 1,024 | ", "| 1,024 | 9", 1), 1)  # a hand edit
    assert stale != doc and doc_tables.render(stale) == doc
