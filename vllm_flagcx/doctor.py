"""``vllm-flagcx doctor``: what the installed vLLM is and what the connector can use of it.

One line per capability: found (and where), or MISSING with what a vendor build must
provide. That list is the vendor porting checklist; ``docs/porting.md`` is rendered from
the same tables. Exit status: 0 when every capability the connector requires is found,
1 when one is missing or no vLLM is installed at all (then it says which builds are
supported and how to install one).
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from typing import Any, TextIO


def collect() -> dict[str, Any]:
    """Everything the doctor reports, as plain data (also the ``--json`` output)."""
    from vllm_flagcx.compat import probe, version
    from vllm_flagcx.matrix import build_for_version

    vllm_version = version.installed_version()
    traits = probe.installed_platform_traits()
    reports = probe.capability_reports()
    build = build_for_version(vllm_version.raw)
    mismatches: dict[str, dict[str, str]] = {}
    if build is not None:
        found = {r.key: r.where for r in reports}
        for key, expected in build.profile.items():
            if found.get(key) != expected:
                mismatches[key] = {"expected": expected, "found": found.get(key, "unknown")}
    return {
        "vllm_version": vllm_version.raw,
        "version_source": version.version_source(),
        "version_parsed": not vllm_version.unreadable,
        "version_override_env": version.VERSION_OVERRIDE_ENV,
        "release": ".".join(map(str, vllm_version.release)),
        "local": vllm_version.local,
        "distribution": version.installed_distribution(),
        "vendor": version.classify_vendor(traits, vllm_version),
        "platform": asdict(traits),
        "matrix_build": build.env if build else None,
        "profile_mismatches": mismatches,
        "capabilities": [asdict(r) for r in reports],
        "missing_required": [r.key for r in reports if r.required and not r.found],
    }


def render(data: dict[str, Any], out: TextIO) -> None:
    p = data["platform"]
    out.write(f"vLLM {data['vllm_version']} (release {data['release']}, "
              f"distribution {data['distribution'] or 'unknown'}; read from "
              f"{data['version_source']})\n")
    if not data["version_parsed"]:
        out.write(f"  the version string does not parse: features decide every branch; "
                  f"set {data['version_override_env']}=<release> (e.g. 0.30.0) to name the API "
                  "it carries\n")
    out.write(f"vendor {data['vendor']}  platform device_name={p['device_name'] or '-'} "
              f"enum={p['enum_name']} cuda_alike={p['is_cuda_alike']}\n")
    build = data["matrix_build"]
    out.write(f"matrix build: {build or 'none (not a supported build; probes decide)'}\n\n")
    for cap in data["capabilities"]:
        need = "required" if cap["required"] else "optional"
        if cap["found"]:
            out.write(f"  ok       {cap['key']:<34} {cap['where']}\n")
        else:
            tag = "MISSING " if cap["required"] else "absent  "
            out.write(f"  {tag} {cap['key']:<34} ({need}) provide: {cap['provide']}\n")
    for key, diff in data["profile_mismatches"].items():
        out.write(f"  DIFFERS  {key}: matrix expects {diff['expected']}, found {diff['found']}\n")
    missing = data["missing_required"]
    if missing:
        out.write(f"\n{len(missing)} required capability(ies) MISSING: {', '.join(missing)}\n")
    else:
        out.write("\nall required capabilities found\n")
    if data.get("plugins_note"):
        out.write(f"WARNING: {data['plugins_note']}\n")


def no_vllm_report() -> dict[str, Any]:
    """The report when this Python has no ``vllm`` package: what is supported, how to
    install it (read from the matrix, the one list of supported builds)."""
    from vllm_flagcx.matrix import builds

    supported = [{"env": b.env, "version": b.version, "label": b.label, "pin": b.pin}
                 for b in builds()]
    newest = supported[-1]["pin"] if supported else "vllm"
    return {
        "vllm_version": None,
        "error": f"no vLLM is installed in this Python ({sys.executable})",
        "fix": (f"install your platform's vLLM build next to vllm-flagcx (upstream: "
                f"pip install {newest}; vendor chips: the vendor's build), or run "
                "`python3 -m tox -e doctor` from a clone, which installs one"),
        "supported_builds": supported,
        "plugins_note": _plugins_note(),
    }


def _plugins_note() -> str | None:
    from vllm_flagcx.compat.plugin import plugins_note

    return plugins_note()


def render_no_vllm(data: dict[str, Any], out: TextIO) -> None:
    out.write(f"{data['error']}.\nsupported vLLM builds:\n")
    for b in data["supported_builds"]:
        out.write(f"  {b['version']:<8} {b['label']}  ({b['pin']})\n")
    out.write(f"fix: {data['fix']}\n")
    if data["plugins_note"]:
        out.write(f"note: {data['plugins_note']}\n")


def missing_dependencies() -> list[str]:
    """This package's own runtime dependencies that are not importable here (a
    ``pip install --no-deps .`` skips them; the doctor then says which, not a traceback)."""
    import importlib.util

    modules = {"packaging": "packaging", "numpy": "numpy", "msgspec": "msgspec",
               "zmq": "pyzmq"}
    return [dist for module, dist in modules.items()
            if importlib.util.find_spec(module) is None]


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    import argparse
    import importlib.util

    parser = argparse.ArgumentParser(prog="vllm-flagcx doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    missing = missing_dependencies()
    if missing:
        out.write(f"vllm-flagcx's own dependencies are not installed: {', '.join(missing)}."
                  f"\nfix: pip install {' '.join(missing)} (or install vllm-flagcx without "
                  "--no-deps)\n")
        return 1
    from vllm_flagcx import machine_report

    if importlib.util.find_spec("vllm") is None:
        report = {**no_vllm_report(), "machine": machine_report.collect()}
        if args.json:
            json.dump(report, out, indent=2)
            out.write("\n")
        else:
            render_no_vllm(report, out)
            machine_report.render(report["machine"], out)
        return 1
    # vLLM logs to stdout from its first import; keep stdout for the report alone.
    with contextlib.redirect_stdout(sys.stderr):
        data = collect()
        data["machine"] = machine_report.collect()
    data["plugins_note"] = _plugins_note()
    if args.json:
        json.dump(data, out, indent=2)
        out.write("\n")
    else:
        render(data, out)
        machine_report.render(data["machine"], out)
    return 1 if data["missing_required"] else 0
