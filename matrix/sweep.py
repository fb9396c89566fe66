"""Every vLLM minor from the floor to the newest: install it, probe it, run the focused suite.

    python -m vllm_flagcx.matrix.sweep                      # every version of [sweep]
    python -m vllm_flagcx.matrix.sweep --versions 0.23.0    # some of them (rows merge)

Why: the tox envs test the builds vendors ship, but vLLM moves every month and a vendor
rebases onto whichever minor it likes; a capability that changed in a minor no env pins
would go unseen until a vendor shipped it. The sweep installs each minor's newest patch the
way tox does (a small venv over the shared base, vLLM ``--no-deps``, the transformers line
its own metadata asks for), records what the probes find and runs ``[suites] focused``.
Its rows (``matrix/sweep.json``, committed) render into docs/porting.md, so the checklist
says which minors were run and what changed between them. It is not part of ``.ci/run``
(22 installs); run it when vLLM releases (``tox -e sweep``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.version import Version

from vllm_flagcx.matrix import BUILDS_FILE, load

REPO = BUILDS_FILE.resolve().parent.parent
RESULTS = BUILDS_FILE.with_name("sweep.json")
PROBE = ("import json; from vllm_flagcx.compat import probe; "
         "print(json.dumps(probe.profile(), sort_keys=True))")
SUITE_SECONDS = 900  # one minor's focused suite; 80-90 s measured on 2 cores


def overlay_for(requires: Iterable[str], overlays: Sequence[Sequence[str]]) -> list[str]:
    """The first overlay whose transformers pin satisfies vLLM's own requirement on it
    (``requires``: the installed vLLM's Requires-Dist lines)."""
    wanted = next((Requirement(r) for r in requires
                   if Requirement(r).name == "transformers"), None)
    for overlay in overlays:
        pin = next(Requirement(p) for p in overlay if Requirement(p).name == "transformers")
        version = next(iter(pin.specifier)).version
        if wanted is None or wanted.specifier.contains(version, prereleases=True):
            return list(overlay)
    raise ValueError(f"no overlay in [sweep].overlays satisfies {wanted}: add one to "
                     f"{BUILDS_FILE.name}")


def suite_counts(output: str) -> dict[str, int]:
    """pytest's closing counts (``3 failed, 170 passed, 5 skipped in 80.1s``)."""
    line = next((ln for ln in reversed(output.splitlines())
                 if re.search(r"\b(passed|failed|error|errors|no tests ran)\b", ln)
                 and " in " in ln), "")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", line):
        counts["errors" if word.startswith("error") else word] = int(number)
    return counts


def profile_changes(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Per row (in version order), the capabilities whose probed value differs from the
    row before it (the first row: none)."""
    out: list[list[str]] = []
    before: Mapping[str, str] | None = None
    for row in rows:
        now = row.get("profile") or {}
        out.append([] if before is None else
                   sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k)))
        before = now
    return out


def _run(args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=dict(env) if env is not None else None)


def sweep_one(version: str, work: Path, base: Path, tests: Sequence[str],
              overlays: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Install ``version`` in its own venv under ``work``, probe it, run ``tests``."""
    started = time.monotonic()
    venv = work / f"vllm-{version}"
    python = str(venv / "bin" / "python")
    creator = getattr(sys, "_base_executable", sys.executable)
    row: dict[str, Any] = {"version": version}
    try:
        _run([creator, "-m", "venv", "--clear", str(venv)], 120).check_returncode()
        _run([python, "matrix/ensure_base.py", str(base)], 3600).check_returncode()
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "--no-deps"]
        _run([*pip, "-e", ".", f"vllm=={version}"], 900).check_returncode()
        requires = json.loads(_run([python, "-c", "import importlib.metadata as m, json; "
                                    "print(json.dumps(m.requires('vllm') or []))"],
                                   60).stdout)
        row["overlay"] = overlay_for(requires, overlays)
        _run([*pip, *row["overlay"]], 900).check_returncode()
        probed = _run([python, "-c", PROBE], 300)
        row["profile"] = json.loads(probed.stdout.strip().splitlines()[-1])
        env = {k: v for k, v in os.environ.items() if k != "VLLM_FLAGCX_MATRIX_ENV"}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        ran = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *tests],
                   SUITE_SECONDS, env)
        row.update(suite_counts(ran.stdout))
        row["failures"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", ran.stdout, re.M)[:20]
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


def merge(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]
          ) -> list[dict[str, Any]]:
    """``old`` rows with ``new`` ones replacing the same version, in version order."""
    rows = {r["version"]: dict(r) for r in old}
    rows.update({r["version"]: dict(r) for r in new})
    return [rows[v] for v in sorted(rows, key=Version)]


def read_rows(path: Path = RESULTS) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["rows"] if path.exists() else []


def main(argv: list[str] | None = None) -> int:
    settings = load()["sweep"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", nargs="+", default=settings["versions"])
    parser.add_argument("--work", type=Path, default=REPO / ".tox" / "sweep-venvs")
    parser.add_argument("--base", type=Path, default=REPO / ".tox" / "shared-base")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    tests = load()["suites"][settings["suite"]]
    new = []
    for version in args.versions:
        row = sweep_one(version, args.work, args.base, tests, settings["overlays"])
        print(f"sweep {version}: {row.get('passed', 0)} passed, {row.get('failed', 0)} "
              f"failed, {row.get('errors', 0)} errors in {row['seconds']} s "
              f"{row.get('error', '')}", flush=True)
        new.append(row)
        rows = merge(read_rows(args.out), new)
        args.out.write_text(json.dumps({"suite": settings["suite"], "rows": rows},
                                       indent=1, sort_keys=True) + "\n")
    return 0 if all(not r.get("failed") and not r.get("errors") and "error" not in r
                    for r in new) else 1


if __name__ == "__main__":
    sys.exit(main())
