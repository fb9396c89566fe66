"""Builds REAL vLLM objects for the tests: VllmConfig, KVCacheConfig, Scheduler, Request.

Nothing here is a stand-in: every object is the installed vLLM's own class. The only
adaptation is to constructor signatures that moved between releases (done through
``vllm_flagcx.compat`` where the product needs it too, by signature filtering here).
Model configs are tiny local ``config.json`` files shipped in tests/models (no hub access).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from testkit import vllm_builders

MODELS = Path(__file__).resolve().parents[1] / "models"
DENSE_MODEL = MODELS / "tiny-dense"
HYBRID_MODEL = MODELS / "tiny-hybrid"
CONNECTOR = "FlagCXConnector"
CONNECTOR_MODULE = "vllm_flagcx.connector"

_request_ids = itertools.count()


def _kwargs_for(callable_: Any, **kwargs: Any) -> dict[str, Any]:
    params = inspect.signature(callable_).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def make_vllm_config(*, model: Path = DENSE_MODEL, block_size: int = 16,
                     hma: bool | None = None, kv_role: str = "kv_both",
                     connector: str | None = CONNECTOR,
                     module_path: str | None = CONNECTOR_MODULE,
                     max_model_len: int = 1024, extra_config: dict | None = None,
                     prefix_caching: bool = False) -> Any:
    """A real VllmConfig on the CPU device with a KV connector (or none)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True,
                               max_model_len=max_model_len, dtype="bfloat16", seed=0)
    scheduler_config = SchedulerConfig(
        **_kwargs_for(SchedulerConfig, max_num_batched_tokens=max_model_len, max_num_seqs=16,
                      max_model_len=max_model_len, is_encoder_decoder=False,
                      enable_chunked_prefill=True,
                      disable_hybrid_kv_cache_manager=None if hma is None else not hma))
    kv_transfer = None
    if connector is not None:
        kv_transfer = KVTransferConfig(
            kv_connector=connector, kv_role=kv_role,
            kv_connector_module_path=module_path,
            kv_connector_extra_config=extra_config or {})
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                      cache_config=CacheConfig(block_size=block_size,
                                               enable_prefix_caching=prefix_caching),
                      device_config=DeviceConfig("cpu"), kv_transfer_config=kv_transfer)


@dataclass(frozen=True)
class HybridLayout:
    """Qwen3.6-style hybrid at small size: [3 GDN + 1 full attention] x ``repeats``."""

    repeats: int = 2
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 256
    num_blocks: int = 64

    @property
    def attention_layers(self) -> list[str]:
        return [f"model.layers.{4 * r + 3}.self_attn.attn" for r in range(self.repeats)]

    @property
    def gdn_layers(self) -> list[str]:
        return [f"model.layers.{4 * r + i}.linear_attn" for r in range(self.repeats)
                for i in range(3)]


def hybrid_kv_cache_config(layout: HybridLayout = HybridLayout()) -> Any:
    """A real hybrid KVCacheConfig: one full-attention group and three GDN groups.

    Grouped as vLLM groups hybrid models: each GDN group has as many layers as the
    attention group, and each backing tensor is shared by one layer of every group. GDN
    pages are padded to the attention page size, conv state first, then ssm state.
    """
    attention = vllm_builders.make_full_attention_spec(
        block_size=layout.block_size, num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size, dtype=torch.bfloat16)
    page = attention.page_size_bytes
    conv_dim, conv_width = 256, 3  # (k-1) x (2*key_dim + value_dim) per rank
    gdn = vllm_builders.make_mamba_spec(
        block_size=layout.block_size,
        shapes=((conv_width, conv_dim), (4, 32, 32)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type="gdn_attention", page_size_padded=page)
    gdn_groups = [layout.gdn_layers[i::3] for i in range(3)]
    groups = [(layout.attention_layers, attention)] + [(names, gdn) for names in gdn_groups]
    tensors = [
        (page * layout.num_blocks, [layout.attention_layers[r]] + [g[r] for g in gdn_groups])
        for r in range(layout.repeats)
    ]
    return vllm_builders.make_kv_cache_config(num_blocks=layout.num_blocks, groups=groups,
                                         tensors=tensors)


def dense_kv_cache_config(num_blocks: int = 64, block_size: int = 16,
                          layers: int = 2) -> Any:
    spec = vllm_builders.make_full_attention_spec(block_size=block_size, num_kv_heads=2,
                                             head_size=64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return vllm_builders.make_kv_cache_config(
        num_blocks=num_blocks, groups=[(names, spec)],
        tensors=[(spec.page_size_bytes * num_blocks, [n]) for n in names])


def scheduler_class(hands_over: bool = True) -> Any:
    """vLLM's v1 Scheduler; by default the package's subclass that hands itself to its
    connector (``--scheduler-cls``, ``compat.schedulers``), as the docs tell a decode of a
    sliding-window model on 0.13-0.28 to run."""
    if hands_over:
        from vllm_flagcx.compat.schedulers import FlagCXScheduler

        return FlagCXScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def make_scheduler(vllm_config: Any, kv_cache_config: Any, cls: Any = None) -> Any:
    """The real v1 Scheduler (``cls``, else ``scheduler_class()``) over a KVCacheConfig."""
    Scheduler = cls or scheduler_class()
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    block_size = min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # as the engine does
    return Scheduler(**_kwargs_for(
        VllmScheduler, vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size, hash_block_size=block_size, log_stats=False))


def block_hasher(block_size: int) -> Any:
    """vLLM's own request block hasher (what the engine attaches for prefix caching)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    return get_request_block_hasher(block_size, sha256_cbor)


def prompt_ids(num_tokens: int) -> list[int]:
    """The default prompt: requests of any length share it as a prefix."""
    return [(i % 400) + 3 for i in range(num_tokens)]


def make_request(num_tokens: int, *, max_tokens: int = 4,
                 kv_transfer_params: dict | None = None, hasher: Any = None,
                 request_id: str | None = None, prompt: list[int] | None = None) -> Any:
    """A real v1 Request with ``num_tokens`` prompt tokens and greedy sampling
    (``request_id``: a given id, as a router's ``X-Request-Id`` header makes it;
    ``prompt``: these token ids instead of the default sequence ``prompt_ids(n)``)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    request_id = request_id or f"req-{next(_request_ids)}"
    prompt = prompt or prompt_ids(num_tokens)
    request = Request(**_kwargs_for(
        Request, request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
        pooling_params=None, eos_token_id=2, arrival_time=0.0, block_hasher=hasher))
    if kv_transfer_params is not None and getattr(request, "kv_transfer_params", None) is None:
        request.kv_transfer_params = kv_transfer_params
    return request


def blocks_in_use(scheduler: Any) -> int:
    """Blocks not free in the scheduler's real block pool (null block excluded)."""
    pool = scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def model_output(scheduler_output: Any, token_id: int = 7,
                 kv_connector_output: Any = None) -> Any:
    """A real ModelRunnerOutput sampling ``token_id`` for every scheduled request that
    finished its prompt in this step (what a model runner would return)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    fields = dict(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                  sampled_token_ids=[[token_id] for _ in req_ids], logprobs=None,
                  prompt_logprobs_dict={}, pooler_output=[],
                  kv_connector_output=kv_connector_output)
    import dataclasses

    names = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    return ModelRunnerOutput(**{k: v for k, v in fields.items() if k in names})


def run_until_done(scheduler: Any, max_steps: int = 64) -> list[Any]:
    """Step the real scheduler with sampled outputs until no request is left (bounded)."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outputs
        sched_out = scheduler.schedule()
        engine_out = scheduler.update_from_output(sched_out, model_output(sched_out))
        outputs.append(engine_out)
    raise AssertionError(f"scheduler still has requests after {max_steps} steps")


@functools.cache
def _connector_output_fields() -> tuple[Any, frozenset[str]]:
    """vLLM's ``KVConnectorOutput`` and its fields, found once (vLLM's model runner
    imports it; a lookup per step would put compat's probe on every request's path)."""
    import dataclasses

    from vllm_flagcx.compat.probe import resolve

    cls = resolve("KVConnectorOutput")
    return cls, frozenset(f.name for f in dataclasses.fields(cls))


def make_connector_output(**fields: Any) -> Any:
    """A real ``KVConnectorOutput`` with only the fields this build has (what vLLM's
    model runner hands the scheduler)."""
    cls, names = _connector_output_fields()
    return cls(**{k: v for k, v in fields.items() if k in names})


def load_failure_fields(*, failed: set[str], invalid_blocks: set[int], per_request: bool,
                        worker_meta: Any) -> dict[str, Any]:
    """KVConnectorOutput fields that report failed receives as vLLM's model runner passes
    them on, per build.

    One KV cache group: block ids (vLLM's ``kv_load_failure_policy`` applies). Several
    groups: block ids cannot be mapped back (vLLM unpacks one group, 0.34 raises), so the
    failure goes per request: ``failed_recving`` (0.34) or our worker metadata (0.18+).
    """
    from vllm_flagcx.compat.capabilities import capabilities

    if not per_request:  # connector.scheduler.reports_failures_per_request
        return {"invalid_block_ids": set(invalid_blocks)}
    mode = capabilities().hybrid_load_failure_report
    if mode == "failed_recving":
        return {"failed_recving": set(failed)}
    if mode == "worker_meta" and failed:
        return {"kv_connector_worker_meta": worker_meta}
    return {}
