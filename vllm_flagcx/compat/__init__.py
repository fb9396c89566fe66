"""The only package that imports vLLM.

It probes the installed build by feature (``probe``), keeps every moved name in one table
(``moved``), and exposes stable wrappers grouped by concern (``connector_api``,
``attention``, ``kv_cache``, ``blocks``, ``mamba``, ``config``). Submodules
import vLLM lazily, so importing ``vllm_flagcx.compat`` itself is cheap.
"""
