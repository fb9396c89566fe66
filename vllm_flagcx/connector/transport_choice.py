"""Which transport a connector instance uses: the registry of names, ``auto``, and loading
a ``module:callable`` factory named in ``kv_connector_extra_config``.

``transport`` names one (flagcx | local | auto; auto = flagcx when libflagcx loads and the
host has an RDMA device, else the same-host transport), or ``transport_factory`` gives a
``module:callable`` taking ``(vllm_config, tp_rank)``. libflagcx is loaded once per
process (``transport.flagcx.load_library``), whether ``auto`` probed it or not.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

TRANSPORTS = {
    "flagcx": "vllm_flagcx.transport.flagcx:create_transport",
    "local": "vllm_flagcx.transport.local:create_transport",
}


def flagcx_available(configured_library: str | None = None, rdma_check: bool = True
                     ) -> bool:
    """True when libflagcx is configured, loads with every symbol the binding calls, and
    (``rdma_check``) this host has an RDMA device for its P2P engine."""
    from vllm_flagcx.transport.flagcx import (
        FlagCXLoadError,
        library_path,
        load_library,
        require_rdma_device,
    )

    try:
        load_library(library_path(configured_library))
        if rdma_check:
            require_rdma_device()
    except FlagCXLoadError:
        return False
    return True


def transport_factory_path(extra: Callable[..., Any]) -> str:
    """``transport_factory`` if given, else the factory of ``transport``."""
    explicit = extra("transport_factory")
    if explicit:
        return str(explicit)
    name = str(extra("transport", "auto"))
    if name == "auto":
        name = ("flagcx" if flagcx_available(extra("flagcx_library"),
                                             bool(extra("flagcx_rdma_check", True)))
                else "local")
    if name not in TRANSPORTS:
        raise ValueError(f"kv_connector_extra_config.transport={name!r} is unknown; use one "
                         f"of {sorted(TRANSPORTS)} or 'auto'")
    return TRANSPORTS[name]


def load_factory(path: str) -> Any:
    """The callable named ``module:callable``; a clear error naming the setting otherwise."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"kv_connector_extra_config.transport_factory={path!r} must be "
                         "'module:callable'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"kv_connector_extra_config.transport_factory={path!r} cannot be "
                         f"loaded ({exc}); name an importable 'module:callable'") from exc
