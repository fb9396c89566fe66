"""vllm-flagcx: FlagCXConnector, a prefill/decode KV connector for vLLM over FlagCX.

Importing this package never imports vLLM, torch or libflagcx: vLLM imports the connector
module from its config code, so import must stay cheap and free of side effects.
"""

__version__ = "0.1.0"
