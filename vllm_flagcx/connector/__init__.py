"""FlagCXConnector, importable as ``kv_connector_module_path="vllm_flagcx.connector"``.

vLLM imports this module from its config code (HMA auto-detection, cudagraph checks), so
importing it only defines classes: no transport, no library load, no threads.

The package itself is light: ``FlagCXConnector`` (which pulls in vLLM through ``compat``)
is resolved on first access (PEP 562), so the router can use the side channel's client
(``wire.client``, ``wire.handshake``) with neither vLLM nor torch installed.
vLLM's loader does ``getattr(module, "FlagCXConnector")``, which this serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_flagcx.connector.entry import FlagCXConnector

__all__ = ["FlagCXConnector"]


def __getattr__(name: str) -> Any:
    if name == "FlagCXConnector":
        from vllm_flagcx.connector.entry import FlagCXConnector

        return FlagCXConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
