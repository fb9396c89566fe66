"""Which transport a connector instance uses: the registry of names, ``auto``, and loading
a ``module:callable`` factory named in ``kv_connector_extra_config``.

``transport`` names one (flagcx | local | auto; auto = flagcx when libflagcx loads and the
host has an RDMA device, else the same-host transport), or ``transport_factory`` gives a
``module:callable`` taking ``(vllm_config, tp_rank)``. Every value is read from the checked
``ConnectorSettings``. libflagcx is loaded once per
process (``transport.flagcx.load_library``), whether ``auto`` probed it or not.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_flagcx.connector.common.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm_flagcx.transport.base import Transport


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


def chosen_transport(settings: ConnectorSettings) -> str:
    """The built-in transport ``settings`` select: ``transport``, with ``auto`` resolved
    (flagcx when libflagcx loads and, unless ``flagcx_rdma_check`` is off, the host has
    an RDMA device; else local)."""
    if settings.transport != "auto":
        return settings.transport
    return ("flagcx" if flagcx_available(settings.flagcx_library, settings.flagcx_rdma_check)
            else "local")


def make_transport(settings: ConnectorSettings, vllm_config: Any, tp_rank: int,
                   host_memory: bool) -> Any:
    """The transport of one worker: ``transport_factory``'s ``module:callable`` called with
    ``(vllm_config, tp_rank)`` when given, else the built-in ``chosen_transport`` opened
    with the checked settings (never the raw extra config: ``flagcx_rdma_check: "off"``
    means off to both the choice and the transport)."""
    if settings.transport_factory:
        from vllm_flagcx.transport.base import Transport

        factory = load_factory(settings.transport_factory)
        try:
            transport = factory(vllm_config, tp_rank)
        except TypeError as exc:
            raise ValueError(
                f"kv_connector_extra_config.transport_factory="
                f"{settings.transport_factory!r}: calling it as factory(vllm_config, "
                f"tp_rank) failed ({exc}); it must take those two arguments and return a "
                "Transport") from None
        if not isinstance(transport, Transport):
            raise ValueError(
                f"kv_connector_extra_config.transport_factory="
                f"{settings.transport_factory!r} returned {type(transport).__name__}, not "
                "a vllm_flagcx.transport.base.Transport")
        return transport
    return BUILT_IN[chosen_transport(settings)](settings, host_memory)


def _open_flagcx(settings: ConnectorSettings, host_memory: bool) -> Transport:
    from vllm_flagcx.transport.flagcx import open_transport

    return open_transport(settings.flagcx_library, settings.side_channel_host,
                          settings.flagcx_rdma_check, host_memory, settings.handshake_timeout)


def _open_local(settings: ConnectorSettings, host_memory: bool) -> Transport:
    from vllm_flagcx.transport.local import LocalTransport

    return LocalTransport()


# The built-in transports by their ``transport`` name (besides "auto"), each opened from
# the checked settings; imported on first use, so choosing one never loads the other.
BUILT_IN: dict[str, Callable[[ConnectorSettings, bool], Transport]] = {
    "flagcx": _open_flagcx,
    "local": _open_local,
}


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
