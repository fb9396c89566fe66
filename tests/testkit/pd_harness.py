"""A prefill and a decode instance in one process: REAL vLLM Schedulers and our workers.

Each instance is vLLM's real ``Scheduler`` (with FlagCXConnector's scheduler half, built by
vLLM's own factory) plus one ``WorkerHalf`` per TP rank over CPU KV tensors laid out the way
vLLM lays them out (hybrid: attention restrided blocks-first with HND heads, GDN
``[conv, ssm]`` views into the same page). ``step`` plays the part of the model runner,
which cannot run here: it binds the step's connector metadata to every worker, collects
``get_finished`` from all ranks (a request is done when every rank says so, as vLLM's output
aggregator does) and feeds a real ``ModelRunnerOutput`` back to the scheduler.
"""

from __future__ import annotations

from testkit import cpu_platform  # noqa: F401 - first: spawned processes import it
from testkit.pd_build import InstanceOptions, build_instance  # noqa: F401 - re-exported
from testkit.pd_caches import (  # noqa: F401 - re-exported
    ATTN_LAYOUTS,
    BLOCK,
    CONV_WIDTH,
    DENSE_HEAD_DIM,
    HEAD_DIM,
    KEY_DIM,
    KV_HEADS,
    MLA_HEAD,
    SLIDING_WINDOW,
    SSM_DIM,
    SSM_HEADS,
    VALUE_DIM,
    RankCaches,
    allocate,
    dense_rank_kv_cache_config,
    mla_rank_kv_cache_config,
    rank_kv_cache_config,
    sliding_rank_kv_cache_config,
)
from testkit.pd_drive import (  # noqa: F401 - re-exported
    aborted,
    assert_attention_bytes_moved,
    assert_idle,
    attention_block_bytes,
    busy,
    finished_ids,
    prefill_process,
    run_decode,
    run_pd,
    run_prefill,
    settle,
    step_prefill,
)
from testkit.pd_instances import (  # noqa: F401 - re-exported
    EntryWorkers,
    Instance,
    free_port,
)
from testkit.transport_standin import Faults  # noqa: F401 - re-exported
