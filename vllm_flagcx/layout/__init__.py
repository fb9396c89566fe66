"""The pure floor: memory regions per layer kind, transfer plans, TP topology.

No vLLM, no torch, no sockets, and no import of any other ``vllm_flagcx`` package: compat
builds regions from vLLM's tensors with it, the connector plans transfers with it, tests
and benchmarks call it directly.
"""
