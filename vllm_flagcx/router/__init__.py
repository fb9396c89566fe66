"""The xPyD proxy: pairs a prefill and a decode instance per request.

``pool`` (instances and the least-loaded choice), ``proxy`` (the two legs of a request and
their failures), ``app`` (the OpenAI-compatible HTTP surface), ``cli`` (``vllm-flagcx
router``). Needs fastapi, uvicorn and httpx (all come with vLLM; ``pip install
vllm-flagcx[router]`` elsewhere).
"""
