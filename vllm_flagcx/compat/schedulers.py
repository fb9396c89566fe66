"""vLLM's schedulers, handing themselves to their connector: ``--scheduler-cls`` values.

vLLM 0.13-0.22 give a KV connector no handle on the scheduler that owns it, and a failed
load of a sliding-window model can only recompute correctly through the scheduler's own
failure set (``compat.recovery``). These subclasses change nothing but that: while vLLM's
``__init__`` builds the connector, the connector can find them. Pick the one that matches
vLLM's async scheduling (``compat.recovery.SCHEDULER_FLAGS``; the connector's refusal
names the one to use).

Importing this module imports vLLM's scheduler; the connector never imports it.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_flagcx.compat.recovery import handing_over


class FlagCXScheduler(Scheduler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        with handing_over(self):
            super().__init__(*args, **kwargs)


class FlagCXAsyncScheduler(AsyncScheduler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        with handing_over(self):
            super().__init__(*args, **kwargs)

