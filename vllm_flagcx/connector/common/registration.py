"""What one worker registered, fixed once at ``register_kv_caches``: its KV cache regions,
their storages as the transport registered them, the fact sheet peers see, and the
readers the integrity checks use.

One frozen record, handed to the side-channel server (prefill) and the puller (decode),
so neither reaches into the other's state and nothing about the registered memory can
change under a running pull.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_flagcx.connector.common import integrity
from vllm_flagcx.layout.regions import Region, kernel_ratios, storage_spans
from vllm_flagcx.wire import handshake as hs

if TYPE_CHECKING:
    from vllm_flagcx.connector.common.worker_settings import WorkerSettings
    from vllm_flagcx.transport.base import Transport


@dataclass(frozen=True)
class Registration:
    regions: tuple[Region, ...]
    kernel_ratios: tuple[int, ...]  # kernel blocks per logical block, per group
    storages: tuple[tuple[int, int], ...]  # registered (address, size), disjoint, sorted
    sheet: hs.FactSheet  # what a peer's handshake is answered with
    # layer -> compat.kv_views.LayerView: what the full digest reads (empty: no digest is
    # sent nor checked)
    views: Mapping[str, Any]
    read_kv: integrity.Reader | None  # the byte sample's reader (None: skipped)


def register(settings: WorkerSettings, transport: Transport, regions: list[Region],
             logical_num_blocks: int | None = None,
             views: Mapping[str, Any] | None = None) -> Registration:
    """Register ``regions``' storages with ``transport`` and describe them to peers."""
    ratios = kernel_ratios(regions, len(settings.layout.block_sizes), logical_num_blocks)
    spans = storage_spans(regions)
    for address, size in spans:
        transport.register(address, size)
    if not settings.host_memory and spans:
        integrity.build_kernels(spans[0][0])
    sheet = hs.make_sheet(layout=settings.layout, engine_id=settings.engine_id,
                          incarnation=settings.incarnation, tp_size=settings.tp_size,
                          tp_rank=settings.tp_rank, transport=transport.name,
                          transport_desc=transport.describe(),
                          regions=tuple(regions))
    read_kv = integrity.reader(settings.host_memory) if settings.verify_integrity else None
    return Registration(tuple(regions), tuple(ratios), tuple(spans), sheet,
                        dict(views or {}), read_kv)
