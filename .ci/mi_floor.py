"""Fail when a Python file's maintainability index (radon's ``mi``, docstrings counted as
comments, as ``radon mi`` does by default) is below a floor: the lint env's guard that no
module grows back into the 20-30 range the worker once had.

    python .ci/mi_floor.py FLOOR PATH...
"""

from __future__ import annotations

import sys
from pathlib import Path

from radon.metrics import mi_visit


def scores(paths: list[str]) -> dict[str, float]:
    files = sorted({f for p in paths for f in (Path(p).rglob("*.py") if Path(p).is_dir()
                                               else [Path(p)])})
    return {str(f): mi_visit(f.read_text(), True) for f in files}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    floor = float(argv[0])
    found = scores(argv[1:])
    low = {f: s for f, s in found.items() if s < floor}
    for f, s in sorted(low.items(), key=lambda x: x[1]):
        print(f"{f}: maintainability index {s:.1f} < {floor:g}: split it by responsibility")
    worst = min(found.items(), key=lambda x: x[1])
    print(f"mi floor {floor:g}: {len(found)} files, lowest {worst[1]:.1f} ({worst[0]})")
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
