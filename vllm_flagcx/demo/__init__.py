"""``vllm-flagcx demo``: the whole PD flow on one machine (``run``), its processes
(``servers``) and its locally generated model (``model``)."""
