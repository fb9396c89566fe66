"""The tables of docs/performance.md, rendered from the benchmarks' own JSON (its ``text``:
what the run printed), so no measured number in the docs is typed by hand.

In the doc, ``<!-- rendered from benchmarks/results/.../X.json -->`` ... ``<!-- end -->``
holds every table of that run; ``python -m benchmarks.doc_tables`` rewrites those regions
(``--check``: exit 1 when one is stale; ``tests/test_doc_tables.py`` runs it).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
REGION = re.compile(r"(<!-- rendered from (\S+) -->\n)(.*?)(<!-- end -->)", re.S)


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def markdown(text: str) -> str:
    """One run's printed tables as markdown: each block (title, header, rows; blocks apart
    by a blank line) a bold title and a table; a block that is not a table stays text."""
    out = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.splitlines()
        header = _cells(lines[1]) if len(lines) > 2 else []
        rows = [_cells(line) for line in lines[2:]]
        if not header or any(len(row) != len(header) for row in rows):
            out.append("\n".join(lines))
            continue
        numeric = [all(re.fullmatch(r"[-+]?[\d,.]+%?", row[i]) for row in rows)
                   for i in range(len(header))]
        table = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
        table += ["| " + " | ".join(row) + " |" for row in rows]
        out.append(f"**{lines[0]}**\n\n" + "\n".join(table))
    return "\n\n".join(out) + "\n"


def render(doc: str, root: Path = ROOT) -> str:
    """``doc`` with every rendered region made from its JSON."""
    def fill(match: re.Match[str]) -> str:
        source = root / match.group(2)
        text = json.loads(source.read_text())["text"]
        return match.group(1) + markdown(text) + match.group(4)

    return REGION.sub(fill, doc)


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    fresh = render(current)
    if "--check" in argv:
        if fresh != current:
            print(f"{DOC} is stale: run python -m benchmarks.doc_tables")
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
