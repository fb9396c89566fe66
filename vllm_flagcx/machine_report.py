"""What ``vllm-flagcx doctor`` says about this machine, with or without vLLM installed.

The CPU class and the kernel library vLLM's CPU build will load on it (and what that
library cannot run), whether libflagcx loads and an RDMA device exists, the transport
``transport: auto`` would choose, and where the side channel would listen with the
default settings; each line that is not fine carries its fix. Needs neither vLLM nor
torch (``compat.cpu_kernels`` reads ``/proc/cpuinfo``).
"""

from __future__ import annotations

from typing import Any


def cpu_report(flags: frozenset[str] | None = None) -> dict[str, Any]:
    """The CPU class and vLLM CPU build's kernel library for it (``compat.cpu_kernels``)."""
    from vllm_flagcx.compat import cpu_kernels

    flags = cpu_kernels.cpu_flags() if flags is None else flags
    native = cpu_kernels.native_class(flags)
    if native is None:
        return {"class": None, "library": None, "reachable": [], "limits": [],
                "fix": "no AVX2 (or not x86): vLLM's x86 CPU build cannot run here; use "
                       "the build of this architecture or a GPU build"}
    limits = list(native.limits)
    if native.hybrid_blocker:
        limits.append(f"GDN hybrid models: {native.hybrid_blocker}")
    return {"class": native.name, "library": native.library,
            "reachable": [c.name for c in cpu_kernels.reachable(flags)],
            "limits": limits, "fix": None}


def flagcx_report(configured_library: str | None = None) -> dict[str, Any]:
    """Whether libflagcx loads (with every symbol the binding calls) and an RDMA device
    exists, and the transport ``auto`` picks from that."""
    from vllm_flagcx.connector.common.settings import ConnectorSettings
    from vllm_flagcx.connector.common.transport_choice import chosen_transport
    from vllm_flagcx.transport.flagcx import (
        FlagCXLoadError,
        library_path,
        load_library,
        rdma_devices,
    )

    library: dict[str, Any] = {"ok": False, "path": None, "detail": None}
    try:
        path = library_path(configured_library)
        library["path"] = str(path)
        loaded = load_library(path)
        library.update(ok=True, detail=getattr(loaded, "version", None))
    except FlagCXLoadError as exc:
        library["detail"] = str(exc)
    except OSError as exc:  # a path that is not a loadable library
        library["detail"] = f"{type(exc).__name__}: {exc}"
    devices = rdma_devices()
    defaults = ConnectorSettings.from_extra(
        {"flagcx_library": configured_library} if configured_library else None)
    auto = chosen_transport(defaults)  # the connector's own rule, not a copy of it
    why = ("libflagcx loads and this host has an RDMA device" if auto == "flagcx" else
           "libflagcx is not loadable here" if not library["ok"] else
           "no RDMA device here")
    return {"libflagcx": library, "rdma_devices": devices,
            "auto_transport": auto, "auto_reason": why}


def side_channel_report() -> dict[str, Any]:
    """Where prefill's side channel listens with the default settings, and how it is
    protected (``connector.settings``; docs/security.md says why)."""
    import os

    from vllm_flagcx.connector.common.settings import ConnectorSettings

    defaults = ConnectorSettings.from_extra(None)
    secret = bool(os.environ.get("FLAGCX_SIDE_CHANNEL_SECRET")
                  or os.environ.get("VLLM_FLAGCX_SIDE_CHANNEL_SECRET"))
    from vllm_flagcx.wire import endpoints

    return {"host": defaults.side_channel_host, "bind": defaults.bind_host,
            "port": defaults.side_channel_port, "secret_in_env": secret,
            "socket_dir": endpoints.socket_dir(),
            "note": ("defaults: prefill TP rank r listens on the Unix socket side-<port + "
                     "r>.sock in socket_dir (+ DP rank x TP size; TCP port + r only with a "
                     "secret); across hosts set kv_connector_extra_config.side_channel_host "
                     "to an address decode can reach, side_channel_bind if it differs, and "
                     "a secret (FLAGCX_SIDE_CHANNEL_SECRET or side_channel_secret_file)")}


def collect() -> dict[str, Any]:
    return {"cpu": cpu_report(), "flagcx": flagcx_report(),
            "side_channel": side_channel_report()}


def render(data: dict[str, Any], out: Any) -> None:
    cpu, fx, side = data["cpu"], data["flagcx"], data["side_channel"]
    out.write("\nthis machine:\n")
    if cpu["class"] is None:
        out.write(f"  cpu      no vLLM x86 CPU class; {cpu['fix']}\n")
    else:
        out.write(f"  cpu      class {cpu['class']}: vLLM's CPU build loads "
                  f"{cpu['library']} (reachable here: {', '.join(cpu['reachable'])}; "
                  "the demo's --cpu-isa picks one)\n")
        for limit in cpu["limits"]:
            out.write(f"           cannot: {limit}\n")
    lib = fx["libflagcx"]
    if lib["ok"]:
        out.write(f"  flagcx   libflagcx loads from {lib['path']}\n")
    else:
        out.write(f"  flagcx   libflagcx not usable: {lib['detail']}\n")
    devices = ", ".join(fx["rdma_devices"]) or "none (/sys/class/infiniband empty or absent)"
    out.write(f"  rdma     devices: {devices}\n")
    out.write(f"  auto     transport 'auto' would choose {fx['auto_transport']} "
              f"({fx['auto_reason']})\n")
    auth = ("secret set in FLAGCX_SIDE_CHANNEL_SECRET" if side["secret_in_env"]
            else "no secret: served on loopback only")
    out.write(f"  side     channel {side['bind']}:{side['port']} by default, {auth}; "
              f"{side['note']}\n")
