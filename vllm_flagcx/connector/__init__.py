"""FlagCXConnector, importable as ``kv_connector_module_path="vllm_flagcx.connector"``.

vLLM imports this module from its config code (HMA auto-detection, cudagraph checks), so
importing it only defines classes: no transport, no library load, no threads.
"""

from vllm_flagcx.connector.entry import FlagCXConnector

__all__ = ["FlagCXConnector"]
