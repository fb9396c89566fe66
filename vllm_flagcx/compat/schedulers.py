"""vLLM's scheduler, handing itself to its connector: the ``--scheduler-cls`` value.

Nothing changes but that, while vLLM's ``__init__`` builds the connector (why:
``compat.vllm_writes``). ``FlagCXScheduler`` builds the async variant when the engine
resolved async scheduling on. Importing this module imports vLLM's scheduler.
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
