"""``vllm.general_plugins`` entry point: register "FlagCXConnector" with vLLM's factory.

vLLM runs general plugins once in every process. The name may already be taken (e.g. by
vllm-plugin-FL, which ships its own FlagCX connector): vLLM's ``register_connector`` raises
ValueError on a duplicate, so we check first, log, and keep theirs.
``kv_connector_module_path="vllm_flagcx.connector"`` works without this plugin.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from vllm_flagcx.compat.probe import resolve

CONNECTOR_NAME = "FlagCXConnector"
CONNECTOR_MODULE = "vllm_flagcx.connector"
ENTRY_POINT_NAME = "flagcx_connector"  # [project.entry-points."vllm.general_plugins"]

logger = logging.getLogger("vllm_flagcx")


def adopt_vllm_logging() -> None:
    """Give the ``vllm_flagcx`` logger vLLM's handlers and level, once, so the connector's
    lines (failures above all) appear in vLLM's log in vLLM's format. vLLM configures only
    its own ``vllm`` logger; without this, INFO lines are dropped."""
    ours, theirs = logging.getLogger("vllm_flagcx"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())


def register() -> bool:
    """Register the connector name; False (and a log line) when it is already registered."""
    factory = resolve("KVConnectorFactory")
    registry = getattr(factory, "_registry", {})
    if CONNECTOR_NAME in registry:
        logger.info("vllm-flagcx: %s is already registered with vLLM (kept the existing "
                    "registration; use kv_connector_module_path=%r to pick ours)",
                    CONNECTOR_NAME, CONNECTOR_MODULE)
        return False
    factory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    return True


def plugins_note(environ: Mapping[str, str] | None = None) -> str | None:
    """What ``VLLM_PLUGINS`` does to this plugin, when it leaves it out; else None.

    vLLM loads only the general plugins named in ``VLLM_PLUGINS`` (comma-separated) when
    the variable is set. The design note's ``export VLLM_PLUGINS=fl`` therefore leaves
    this package's plugin unloaded, and ``"kv_connector": "FlagCXConnector"`` alone then
    fails ~100 s into engine start with vLLM's "Unsupported connector type"."""
    env = os.environ if environ is None else environ
    if "VLLM_PLUGINS" not in env:
        return None
    allowed = env["VLLM_PLUGINS"].split(",")
    if ENTRY_POINT_NAME in allowed:
        return None
    return (f"VLLM_PLUGINS={env['VLLM_PLUGINS']!r} leaves out this package's plugin "
            f"{ENTRY_POINT_NAME!r}, so vLLM does not know the name {CONNECTOR_NAME!r}; "
            f"fix: add it (VLLM_PLUGINS={env['VLLM_PLUGINS']},{ENTRY_POINT_NAME}), unset "
            f"VLLM_PLUGINS, or pass \"kv_connector_module_path\": \"{CONNECTOR_MODULE}\" "
            "in --kv-transfer-config")
