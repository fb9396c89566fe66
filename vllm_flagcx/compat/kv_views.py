"""Each attention layer's KV cache as vLLM indexes it: ``(blocks, tokens, heads, channels)``
views for the logical integrity check (``layout.logical``).

Why apart from ``kv_layout``: that module turns strides into byte regions, the arithmetic
a wrong answer hides in. These views use only the dimension NAMES each build declares (the
backend's ``get_kv_cache_shape`` letters for 5-d caches, 0.34's ``[B, H, N, C]``, MLA's
``(B, N, D)``) and let the tensor's own indexing find the bytes, so a region or plan
mistake shows up as a mismatch instead of being checked against itself.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_flagcx.compat.kv_cache import SpecKind, spec_kind
from vllm_flagcx.compat.kv_layout import kv_dimension
from vllm_flagcx.layout.logical import LayerFacts


@dataclass(frozen=True)
class AttentionView:
    """One layer: ``parts`` are ``(kernel blocks, tokens, local heads, channels)`` views
    (K and V, or one packed K||V / latent view) of the very tensor vLLM registered."""

    parts: tuple[Any, ...]
    facts: LayerFacts
    ratio: int  # kernel blocks per logical block

    @property
    def kernel_block_size(self) -> int:
        return int(self.parts[0].shape[1])

    @functools.cached_property
    def geometry(self) -> tuple[tuple[int, ...], ...] | None:
        """Per part: (address, the three strides, the three sizes in elements, bytes of
        one element vector, bytes per element); None when a part's channels are not
        contiguous. Read once: a registered cache never moves."""
        out = []
        for part in self.parts:
            if part.dim() != 4 or part.stride(3) != 1:
                return None
            size = int(part.element_size())
            out.append((int(part.data_ptr()), *(int(x) for x in part.stride()[:3]),
                        *(int(x) for x in part.shape[:3]), int(part.shape[3]) * size, size))
        return tuple(out)

    def crcs(self, kernel_blocks: Sequence[int], slots: Sequence[int],
             local_heads: Sequence[int]) -> list[int]:
        """crc32 of each (kernel block, slot, local head) element vector, K then V."""
        return crcs_batched([(self, kernel_blocks, slots, local_heads)])[0]


Lookup = tuple[AttentionView, Sequence[int], Sequence[int], Sequence[int]]


# reads (address, size) ranges at once (``connector.integrity.Reader``)
RangeReader = Callable[[Sequence[tuple[int, int]]], list[bytes]]


def element_ranges(lookups: Sequence[Lookup]) -> list[list[tuple[int, int]]] | None:
    """Per key of every lookup, in order: the byte range of each part's element vector
    (K then V), placed by the tensor's own strides (what its indexing computes); None when
    a part's channels are not contiguous. An index outside a part's shape raises
    IndexError, as indexing would: these ranges are read raw."""
    out: list[list[tuple[int, int]]] = []
    for view, blocks, slots, heads in lookups:
        geometry = view.geometry
        if geometry is None:
            return None
        for b, s, h in zip(blocks, slots, heads, strict=True):
            ranges = []
            for address, s0, s1, s2, n0, n1, n2, nbytes, size in geometry:
                if not (0 <= b < n0 and 0 <= s < n1 and 0 <= h < n2):
                    raise IndexError(f"(block, slot, head) {(b, s, h)} outside a cache view "
                                     f"of shape {(n0, n1, n2)}")
                ranges.append((address + (b * s0 + s * s1 + h * s2) * size, nbytes))
            out.append(ranges)
    return out


def crcs_batched(lookups: Sequence[Lookup], read: RangeReader | None = None
                 ) -> list[list[int]]:
    """``AttentionView.crcs`` of several layers at once. With ``read`` (the byte sample's
    reader) and contiguous channels: every element vector's bytes read in one call (on a
    GPU one gather launch; B5 on an H100 measured ~1.5 ms per side for the torch gathers
    below inside a serving engine). Else through torch: one host-to-device copy of every
    index and one device-to-host copy of every element read, on a stream of the check's
    own."""
    if not lookups:
        return []
    if read is not None:
        ranges = element_ranges(lookups)
        if ranges is not None:
            return _crcs_of_ranges(lookups, ranges, read)
    return _crcs_by_torch(lookups)


def _crcs_of_ranges(lookups: Sequence[Lookup], ranges: list[list[tuple[int, int]]],
                    read: RangeReader) -> list[list[int]]:
    """Every key's ranges read in one call, a crc per key, split back per lookup."""
    pieces = iter(read([r for key in ranges for r in key]))
    crcs = []
    for key in ranges:
        crc = 0
        for _ in key:
            crc = zlib.crc32(next(pieces), crc)
        crcs.append(crc)
    out, at = [], 0
    for _, _, slots, _ in lookups:
        out.append(crcs[at:at + len(slots)])
        at += len(slots)
    return out


def _crcs_by_torch(lookups: Sequence[Lookup]) -> list[list[int]]:
    import torch

    device = lookups[0][0].parts[0].device
    with _side_stream(device):
        flat = [int(x) for _, b, s, h in lookups for x in (*b, *s, *h)]
        index = torch.as_tensor(flat, dtype=torch.long).to(device)
        chunks, pos = [], 0
        for view, _, slots, _ in lookups:
            n = len(slots)
            b, s, h = index[pos:pos + n], index[pos + n:pos + 2 * n], index[pos + 2 * n:
                                                                            pos + 3 * n]
            pos += 3 * n
            rows = torch.cat([p[b, s, h].reshape(n, -1) for p in view.parts], dim=1)
            chunks.append(rows.contiguous().view(torch.uint8).reshape(-1))
        raw = torch.cat(chunks).cpu().numpy()
    out, offset = [], 0
    for (_, _, slots, _), chunk in zip(lookups, chunks, strict=True):
        width = int(chunk.numel()) // max(1, len(slots))
        out.append([zlib.crc32(raw[offset + i * width:offset + (i + 1) * width].tobytes())
                    for i in range(len(slots))])
        offset += int(chunk.numel())
    return out


_STREAMS: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    """On a GPU, a stream of the check's own: its few-KiB gathers and copy then wait for
    none of the engine's kernels queued on the default stream (the blocks it reads are
    this request's, which no running kernel writes). Elsewhere, nothing."""
    import contextlib

    import torch

    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS.setdefault(device, torch.cuda.Stream(device=device))
    return torch.cuda.stream(stream)


def _five_d_parts(cache: Any, dims: str | None) -> tuple[Any, ...]:
    if dims is None:  # the shape families, as kv_layout reads them
        dims = "2BNHD" if kv_dimension(tuple(int(n) for n in cache.shape), "") == 0 \
            else "B2NHD"
    ordered = cache.permute(*[dims.index(c) for c in "2BNHD"])
    return ordered[0], ordered[1]


def layer_parts(cache: Any, kind: SpecKind, dims: str | None) -> tuple[Any, ...]:
    """The ``(B, N, H, C)`` views of one attention layer's cache tensor."""
    if kind is SpecKind.MLA:
        return (cache.unsqueeze(2),)
    if cache.dim() == 5:
        return _five_d_parts(cache, dims)
    if cache.dim() == 4:  # 0.34: logical [B, H, N, C] whatever the memory order
        return (cache.permute(0, 2, 1, 3),)
    raise ValueError(f"attention cache of shape {tuple(cache.shape)} has no known logical "
                     "dimensions")


def attention_views(kv_caches: dict[str, Any], kv_cache_config: Any,
                    total_kv_heads: int, attention_dims: dict[int, str | None] | None,
                    kernel_ratios: Sequence[int]) -> dict[str, AttentionView]:
    """A view per attention (and MLA) layer; Mamba layers have none (their state is
    checked by the byte sample)."""
    views: dict[str, AttentionView] = {}
    for group_index, group in enumerate(kv_cache_config.kv_cache_groups):
        kind = spec_kind(group.kv_cache_spec)
        if kind is SpecKind.MAMBA:
            continue
        dims = (attention_dims or {}).get(group_index)
        for name in group.layer_names:
            parts = layer_parts(kv_caches[name], kind, dims)
            ratio = int(kernel_ratios[group_index])
            facts = LayerFacts(group_index, int(parts[0].shape[1]) * ratio,
                               1 if kind is SpecKind.MLA else int(total_kv_heads))
            views[name] = AttentionView(tuple(parts), facts, ratio)
    return views
