"""The test kit: real vLLM parts wired the way the engine wires them, and the few stand-ins
for what cannot exist on a CPU-only machine (each named a stand-in in its own docstring).

- ``cpu_platform``: vLLM's real CpuPlatform in test processes (import first);
- ``vllm_harness``: real Scheduler / KVCacheManager / Request builders for every matrix build;
- ``vllm_builders``: version-portable KV cache specs and configs (moved here from compat,
  where only tests used them);
- ``pd_harness``: prefill + decode FlagCXConnector instances over real caches, driven step by
  step as vLLM's model runner does;
- ``peers``: transport peers in spawned processes;
- ``router_standin``, ``transport_standin``: stand-in upstreams and an in-process transport;
- ``flagcx_real``: builds the real libflagcx from the vendored snapshot.

Importing the package imports none of them (``cpu_platform`` must come before vLLM).
The benchmarks import it as a package too (``benchmarks.use_test_helpers``).
"""
