"""Every contract that crosses a process or HTTP boundary, one definition each:
``params`` (the ``kv_transfer_params`` schema the router, prefill and decode exchange),
``handshake`` (side-channel messages and the compatibility check), ``auth`` (their MAC),
``client`` (one request, one answer; decode's lease renewals).

Imports only ``vllm_flagcx.layout`` and msgspec/pyzmq: the router uses it without vLLM or
torch.
"""
