"""vLLM's scheduler, handing itself to its connector: the ``--scheduler-cls`` value.

vLLM 0.13-0.28 give a KV connector no handle on the scheduler that owns it, and a failed
load of a sliding-window model can only recompute correctly through the scheduler's own
failure set (``compat.vllm_writes``). These subclasses change nothing but that: while vLLM's
``__init__`` builds the connector, the connector can find them. One value serves both of
vLLM's modes (``compat.vllm_writes.SCHEDULER_FLAG``): ``FlagCXScheduler`` builds the async
variant when the engine resolved async scheduling on, as vLLM's own default does.

Importing this module imports vLLM's scheduler; the connector never imports it.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_flagcx.compat.vllm_writes import handing_over


def _async_scheduling(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    config = kwargs.get("vllm_config", args[0] if args else None)
    return bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", False))


class FlagCXScheduler(Scheduler):
    def __new__(cls, *args: object, **kwargs: object) -> Scheduler:
        if cls is FlagCXScheduler and _async_scheduling(args, kwargs):
            return FlagCXAsyncScheduler(*args, **kwargs)  # built whole: not our type
        return super().__new__(cls)

    def __init__(self, *args: object, **kwargs: object) -> None:
        with handing_over(self):
            super().__init__(*args, **kwargs)


class FlagCXAsyncScheduler(AsyncScheduler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        with handing_over(self):
            super().__init__(*args, **kwargs)
