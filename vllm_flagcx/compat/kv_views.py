"""Each layer's cache as vLLM indexes it, in logical units, and the full logical digest
(``layout.digest``) computed over it with torch on whatever device holds it.

Why apart from ``kv_layout``: that module turns strides into byte regions, the arithmetic
a wrong answer hides in. These views use only the dimension NAMES each build declares (the
backend's ``get_kv_cache_shape`` letters for 5-d caches, 0.34's ``[B, H, N, C]``, MLA's
``(B, N, D)``, the Mamba state's conv / ssm shapes) and let the tensor's own indexing find
the bytes, so a region or plan mistake shows up as a digest mismatch instead of being
checked against itself.

Every part is a ``(kernel blocks, tokens, units, *unit)`` view: ``units`` are what TP
shards (KV heads; conv channels per GDN section; ssm heads), ``tokens`` the slots of a
kernel block (1 for a state). One request's digest is a gather of its blocks per part
(one copy, in logical order) and three integer reductions; nothing is read per element
from Python.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_flagcx.compat.kv_cache import SpecKind, spec_kind
from vllm_flagcx.compat.kv_layout import kv_dimension
from vllm_flagcx.compat.vllm_types import KVCacheConfigLike
from vllm_flagcx.layout import digest
from vllm_flagcx.layout.plans import expand_to_kernel_blocks

if TYPE_CHECKING:
    from torch import Tensor, device


@dataclass(frozen=True)
class Part:
    """One TP-sharded part of a layer: ``view`` is ``(kernel blocks, tokens, units, ...)``
    of the very tensor vLLM registered; this rank holds global units
    ``[first_unit, first_unit + units)`` of ``global_units``."""

    name: str
    view: Tensor
    first_unit: int
    global_units: int
    replicated: bool = False  # every rank holds all units (MLA latents)


@dataclass(frozen=True)
class LayerView:
    group: int
    parts: tuple[Part, ...]
    ratio: int = 1  # kernel blocks per logical block


def _written_parts(views: Mapping[str, LayerView], block_ids: Sequence[Sequence[int]],
                   me: tuple[int, int], peer: tuple[int, int], sending: bool
                   ) -> Iterator[tuple[str, LayerView, Part, range, Sequence[int]]]:
    """(layer, its view, part, the global units of it in this transfer, the group's block
    ids) for every part with bytes in the transfer: what both the torch digest and the
    kernel's tiles cover. ``me`` (rank, TP) writes into ``peer`` (``sending``) or
    receives from it."""
    sender, receiver = (me, peer) if sending else (peer, me)
    for name, layer in views.items():
        ids = block_ids[layer.group] if layer.group < len(block_ids) else ()
        if not len(ids):
            continue
        for part in layer.parts:
            units = digest.written_units(sender, receiver, part.global_units, part.replicated)
            if len(units):
                yield name, layer, part, units, ids


_WORD_DTYPES: dict[int, str] = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}


@functools.lru_cache(maxsize=4096)
def _weights(salt: int, count: int, start: int, device: device) -> Tensor:
    import torch

    return torch.from_numpy(digest.weights(salt, count, start).view(np.int64)).to(device)


def _prefix_weights(salt: int, count: int, device: device) -> Tensor:
    """The first ``count`` weights of ``salt``, sliced from a table of the next power of
    two (token counts vary per request; the tables stay few)."""
    return _weights(salt, 1 << max(0, count - 1).bit_length(), 0, device)[:count]


def _part_sum(part: Part, layer: str, index: Tensor, units: range, device: device
              ) -> Tensor:
    """This part's share of the layer digest (a 0-d int64 tensor on ``device``)."""
    import torch

    lo = units.start - part.first_unit
    x = part.view[:, :, lo:lo + len(units)][index]  # one gather, logical order
    tokens = x.shape[0] * x.shape[1]
    raw = x.reshape(tokens, len(units), -1).contiguous().view(torch.uint8)
    width = digest.word_bytes(int(raw.shape[-1]))
    words = raw.view(getattr(torch, _WORD_DTYPES[width])).to(torch.int64)
    per_row = (words * _prefix_weights(digest.WORD_SALT, int(words.shape[-1]), device)).sum(-1)
    per_row = (per_row * _prefix_weights(digest.TOKEN_SALT, tokens, device)[:, None]).sum(0)
    rows = _weights(digest.salt(layer, part.name), len(units), units.start, device)
    return (per_row * rows).sum()


def layer_digests(views: Mapping[str, LayerView], block_ids: Sequence[Sequence[int]],
                  me: tuple[int, int], peer: tuple[int, int], sending: bool
                  ) -> dict[str, int]:
    """Per layer with bytes in this transfer: its digest over the units ``me`` (rank, TP)
    writes into ``peer`` (``sending``) or receives from it, over this side's ``block_ids``
    per group in the transfer's pair order. One device-to-host copy for all layers."""
    import torch

    sums: dict[str, list[Tensor]] = {}
    with _side_stream(next(iter(views.values())).parts[0].view.device if views else None):
        indexes: dict[tuple[int, int], Tensor] = {}
        for name, layer, part, units, ids in _written_parts(views, block_ids, me, peer,
                                                            sending):
            device = part.view.device
            key = (layer.group, layer.ratio)
            if key not in indexes:
                indexes[key] = torch.from_numpy(
                    expand_to_kernel_blocks(ids, layer.ratio)).to(device)
            sums.setdefault(name, []).append(_part_sum(part, name, indexes[key], units,
                                                       device))
        if not sums:
            return {}
        flat = torch.stack([s for parts in sums.values() for s in parts]).cpu().numpy()
    values = iter(flat.view(np.uint64).tolist())
    return {name: sum(next(values) for _ in parts) & digest.MASK
            for name, parts in sums.items()}


def _tile(part: Part, units: range, layer: str, ids_at: int, blocks: int,
          slot: int) -> list[int] | None:
    """One part's digest tile (``transport.cuda_kernel.DIGEST_TILE_WORDS`` fields) from
    its view's own strides, or None where a row's words are not evenly strided or
    aligned for the kernel (the torch path then digests it)."""
    view = part.view
    dims, strides = list(view.shape[3:]), list(view.stride()[3:])
    if any(strides[i] != strides[i + 1] * dims[i + 1] for i in range(len(dims) - 1)):
        return None
    elem = int(view.element_size())
    row_elems = int(np.prod(dims)) if dims else 1
    width = digest.word_bytes(row_elems * elem)
    step = int(strides[-1]) if dims else 1
    if step == 1:
        word_stride, words = width, row_elems * elem // width
    elif width == elem:
        word_stride, words = step * elem, row_elems
    else:
        return None
    base = int(view.data_ptr()) + (units.start - part.first_unit) * int(view.stride(2)) * elem
    block, token, row = (int(view.stride(i)) * elem for i in range(3))
    if any(x % width for x in (base, block, token, row, word_stride)):
        return None
    return [base, block, token, row, word_stride, int(view.shape[1]), blocks, ids_at,
            len(units), words, units.start, digest.salt(layer, part.name), width, slot]


def digest_tiles(views: Mapping[str, LayerView], block_ids: Sequence[Sequence[int]],
                 me: tuple[int, int], peer: tuple[int, int], sending: bool
                 ) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """``layer_digests``' work as one kernel's input: (the layers in slot order, the tiles
    as uint64, the kernel block ids they index); None when a part needs the torch path."""
    names: list[str] = []
    tiles: list[list[int]] = []
    ids: list[np.ndarray] = []
    at: dict[tuple[int, int], int] = {}
    size = 0
    for name, layer, part, units, group_ids in _written_parts(views, block_ids, me, peer,
                                                              sending):
        key = (layer.group, layer.ratio)
        if key not in at:
            ids.append(expand_to_kernel_blocks(group_ids, layer.ratio))
            at[key] = size
            size += int(ids[-1].size)
        if not names or names[-1] != name:
            names.append(name)
        tile = _tile(part, units, name, at[key], len(group_ids) * layer.ratio,
                     len(names) - 1)
        if tile is None:
            return None
        tiles.append(tile)
    flat = np.asarray([x & digest.MASK for t in tiles for x in t], dtype=np.uint64)
    return names, flat, (np.concatenate(ids) if ids else np.zeros(0, np.int64))


_STREAMS: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    """On a GPU, a stream of the check's own: its gathers wait for none of the engine's
    kernels queued on the default stream (the blocks it reads are this request's, which
    no running kernel writes). Elsewhere, nothing."""
    import torch

    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS.setdefault(device, torch.cuda.Stream(device=device))
    return torch.cuda.stream(stream)


def _five_d_parts(cache: Tensor, dims: str | None) -> tuple[Tensor, ...]:
    if dims is None:  # the shape families, as kv_layout reads them
        dims = "2BNHD" if kv_dimension(tuple(int(n) for n in cache.shape), "") == 0 \
            else "B2NHD"
    ordered = cache.permute(*[dims.index(c) for c in "2BNHD"])
    return ordered[0], ordered[1]


def layer_parts(cache: Tensor, kind: SpecKind, dims: str | None) -> tuple[Tensor, ...]:
    """The ``(B, N, H, C)`` views of one attention layer's cache tensor."""
    if kind is SpecKind.MLA:
        return (cache.unsqueeze(2),)
    if cache.dim() == 5:
        return _five_d_parts(cache, dims)
    if cache.dim() == 4:  # 0.34: logical [B, H, N, C] whatever the memory order
        return (cache.permute(0, 2, 1, 3),)
    raise ValueError(f"attention cache of shape {tuple(cache.shape)} has no known logical "
                     "dimensions")


def _state_tensors(cache: Tensor | Sequence[Tensor], spec: Any) -> tuple[Tensor, Tensor]:
    """(conv, ssm) of a Mamba layer: vLLM's own two views (<= 0.22), or the spec's shapes
    over 0.34's one int8 page per block."""
    if not hasattr(cache, "data_ptr"):
        return cache[0], cache[1]
    assert not isinstance(cache, Sequence)
    (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = spec.shapes[:2], spec.dtypes[:2]
    blocks = int(cache.shape[0])
    conv_bytes = int(np.prod(conv_shape)) * conv_dtype.itemsize
    ssm_bytes = int(np.prod(ssm_shape)) * ssm_dtype.itemsize
    page = cache.view(blocks, -1)
    return (page[:, :conv_bytes].view(conv_dtype).view(blocks, *conv_shape),
            page[:, conv_bytes:conv_bytes + ssm_bytes].view(ssm_dtype)
            .view(blocks, *ssm_shape))


def state_parts(cache: Tensor | Sequence[Tensor], spec: Any, conv_layout: str,
                sections: Sequence[tuple[str, int, int]], rank: int, tp: int
                ) -> tuple[Part, ...]:
    """A Mamba/GDN layer's parts: one per conv section (``(name, local channels, global
    channels)``, GDN's Q | K | V) and the ssm state, with one token per block."""
    conv, ssm = _state_tensors(cache, spec)
    by_channel = conv if conv_layout == "DS" else conv.transpose(1, 2)  # (B, ch, state)
    parts, at = [], 0
    for name, local, global_ in sections:
        parts.append(Part(f"conv_{name}", by_channel[:, at:at + local].unsqueeze(1),
                          rank * local, global_))
        at += local
    heads = int(ssm.shape[1])
    parts.append(Part("ssm", ssm.unsqueeze(1), rank * heads, heads * tp))
    return tuple(parts)


def cache_views(kv_caches: Mapping[str, Tensor], kv_cache_config: KVCacheConfigLike,
                total_kv_heads: int,
                attention_dims: Mapping[int, str | None] | None,
                kernel_ratios: Sequence[int], rank: int, tp: int, conv_layout: str,
                conv_sections: Sequence[tuple[str, int, int]] | None) -> dict[str, LayerView]:
    """A view per registered layer: attention (K and V, or MLA's latent) and Mamba/GDN
    state (``conv_sections``: None reads the conv channels as one section)."""
    from vllm_flagcx.layout.topology import head_range

    views: dict[str, LayerView] = {}
    for group_index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = spec_kind(spec)
        for name in group.layer_names:
            cache = kv_caches[name]
            if kind is SpecKind.MAMBA:
                sections = conv_sections
                if sections is None:
                    conv = _state_tensors(cache, spec)[0]
                    channels = int(conv.shape[1 if conv_layout == "DS" else 2])
                    sections = (("conv", channels, channels * tp),)
                views[name] = LayerView(group_index, state_parts(
                    cache, spec, conv_layout, sections, rank, tp))
                continue
            raw = layer_parts(cache, kind, (attention_dims or {}).get(group_index))
            parts: tuple[Part, ...]
            if kind is SpecKind.MLA:
                parts = (Part("latent", raw[0], 0, 1, replicated=True),)
            else:
                first = head_range(rank, tp, int(total_kv_heads))[0]
                parts = tuple(Part(n, p, first, int(total_kv_heads))
                              for n, p in zip(("k", "v") if len(raw) == 2 else ("kv",), raw,
                                              strict=True))
            views[name] = LayerView(group_index, parts, int(kernel_ratios[group_index]))
    return views
