"""Read the KV cache tensors vLLM hands to ``register_kv_caches`` into connector regions.

The only place that knows how each release lays KV memory out (the connector's region
functions take plain numbers):

* <= 0.22 attention: 5-d, its dimensions named by the backend's own
  ``get_kv_cache_shape`` (``compat.attention.declared_dims``: "2BNHD" FLASH_ATTN family,
  "B2NHD" FLASHINFER/TRITON_ATTN, "2BHND" CPU_ATTN); where no backend can be read, the
  shape families ``(2, num_blocks, ...)`` / ``(num_blocks, 2, ...)`` (``kv_dimension``).
  Layer-first (the K/V dimension strides outermost) gives two regions; otherwise (vLLM's
  hybrid restride, or the second family) the layout is blocks-first, K and V inside each
  block. Heads must be the outer dimension inside a block (HND) to be sliced for
  heterogeneous TP.
* <= 0.22 Mamba: a list ``[conv, ssm]`` of views into one page: conv at 0, ssm right after.
* MLA: 3-d ``(num_blocks, block_size, head_size)``, one region.
* 0.34: every attention layer is one ``[B, H, N, C]`` tensor with K||V in C; a Mamba layer
  is one int8 page view.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from vllm_flagcx.compat.kv_cache import SpecKind, spec_kind
from vllm_flagcx.compat.vllm_types import KVCacheConfigLike
from vllm_flagcx.layout import regions as R


def _nbytes_stride(tensor: torch.Tensor, dim: int) -> int:
    return int(tensor.stride(dim)) * int(tensor.element_size())


def one_run(tensor: torch.Tensor) -> bool:
    """Do ``tensor``'s elements form one gap-free run of memory, in SOME dimension order?

    Every byte count below (a head, a block, a state) is a product of sizes that is only
    right when the part it describes has no gaps; vLLM's layouts permute dimensions
    freely, so the order is read from the strides (size-1 dimensions say nothing)."""
    dims = sorted((int(tensor.stride(i)), int(tensor.shape[i])) for i in range(tensor.dim())
                  if int(tensor.shape[i]) > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _require_run(part: torch.Tensor, name: str, what: str) -> None:
    if not one_run(part):
        raise R.RegionError(
            f"{name}: {what} of shape {tuple(int(n) for n in part.shape)} and strides "
            f"{tuple(int(x) for x in part.stride())} is not one contiguous run, so its bytes "
            "cannot be counted per head or per block; this layout is not supported (start "
            "the engine with its default KV cache layout)")


def kv_dimension(shape: tuple[int, ...], name: str) -> int:
    """Which of a 5-d attention cache's first two dimensions splits K from V.

    FLASH_ATTN, FLEX_ATTENTION and the ROCm backends declare ``(2, num_blocks, N, H, D)``;
    FLASHINFER and TRITON_ATTN ``(num_blocks, 2, N, H, D)`` (both read from vLLM 0.22's
    ``get_kv_cache_shape``). Each backend's stride order then decides the physical order,
    which the strides show. With exactly 2 blocks the shape alone cannot say: refused."""
    if shape[0] == 2 and shape[1] != 2:
        return 0
    if shape[1] == 2 and shape[0] != 2:
        return 1
    raise R.RegionError(f"{name}: attention cache of shape {shape}: with 2 blocks the K/V "
                        "dimension is ambiguous; give the engine more KV cache blocks")


def _block_dims(cache: torch.Tensor, name: str, dims: str | None) -> tuple[int, int, int]:
    """(K/V dimension, tokens and heads dimensions of one of K or V) of a 5-d cache: from
    the backend's declared ``dims`` when known, else from the shape (the (2, B, N, H, D)
    and (B, 2, N, H, D) families)."""
    if dims is None:
        return kv_dimension(tuple(int(n) for n in cache.shape), name), 1, 2
    inner = dims.replace("2", "")
    if inner[0] != "B":
        raise R.RegionError(f"{name}: the backend declares dimensions {dims}; only layouts "
                            "with blocks outside K/V can be moved per block")
    return dims.index("2"), inner.index("N"), inner.index("H")


def attention_regions(name: str, cache: torch.Tensor, spec: Any, group: int, tp_size: int,
                      total_kv_heads: int, dims: str | None = None) -> list[R.Region]:
    """K/V regions of one attention layer. ``dims``: what its backend declares
    (``compat.attention.declared_dims``); without it the 5-d shape families are read."""
    kind = spec_kind(spec).value
    if cache.dim() == 5 and (dims is not None or 2 in (int(cache.shape[0]),
                                                       int(cache.shape[1]))):
        kv_dim, tokens_dim, heads_dim = _block_dims(cache, name, dims)
        # K and V: (B, N, H, D) or (B, H, N, D) each; HND when heads stride outermost
        # inside a block
        k, v = cache.select(kv_dim, 0), cache.select(kv_dim, 1)
        heads = int(spec.num_kv_heads)
        if int(k.shape[heads_dim]) != heads:
            raise R.RegionError(f"{name}: dimension {heads_dim} of K has {k.shape[heads_dim]}"
                                f" entries, the spec {heads} KV heads (dims {dims})")
        if not one_run(k[0]):
            if kv_dim == 1 and one_run(cache[0]):
                # K and V alternate inside each token (FLEX_ATTENTION on 0.23-0.25: physical
                # (B, N, 2, H, D)): a block is one run and moves whole, equal TP sizes only
                block = cache[0]
                return R.attention_packed_kv(
                    layer=name, group=group, kind=kind, base=block.data_ptr(),
                    block_stride=_nbytes_stride(cache, 0), num_blocks=int(cache.shape[0]),
                    heads=heads, global_heads=total_kv_heads,
                    head_bytes=int(block.numel() * block.element_size()) // heads,
                    interleaved=True)
            _require_run(k[0], name, "one block of K")  # raises, naming the layout
        hnd = k.stride(heads_dim) > k.stride(tokens_dim)
        head_bytes = (_nbytes_stride(k, heads_dim) if hnd
                      else int(k[0].numel() * k.element_size()) // heads)
        # NHD (heads inside each token): moves whole blocks only, so between equal TP
        # sizes; a peer with another TP size is refused by the section name.
        common: dict[str, Any] = dict(
            layer=name, group=group, kind=kind, num_blocks=int(k.shape[0]), heads=heads,
            global_heads=total_kv_heads, head_bytes=head_bytes, interleaved=not hnd)
        if cache.stride(kv_dim) > cache.stride(1 - kv_dim):
            return R.attention_layer_first(k_base=k.data_ptr(), v_base=v.data_ptr(),
                                           block_stride=_nbytes_stride(k, 0), **common)
        v_offset = v.data_ptr() - k.data_ptr()
        if v_offset != heads * head_bytes:
            raise R.RegionError(f"{name}: V starts {v_offset} bytes after K in a block, "
                                f"expected {heads * head_bytes}")
        return R.attention_blocks_first(base=k.data_ptr(), block_stride=_nbytes_stride(k, 0),
                                        **common)
    if cache.dim() == 4:  # 0.34 [B, H, N, C], K||V in C
        return packed_kv_regions(name, cache, group, kind, total_kv_heads)
    raise R.RegionError(f"{name}: attention cache of shape {tuple(cache.shape)} is not a "
                        "known layout")


def physical_order(cache: torch.Tensor, dims: str) -> str:
    """The letters of ``dims`` (one per logical dimension of ``cache``) ordered from the
    largest stride to the smallest: the memory order the tensor really has, whatever
    layout was asked for (size-1 dimensions last, their stride says nothing)."""
    ranked = sorted(range(len(dims)), key=lambda i: (int(cache.shape[i]) > 1,
                                                     int(cache.stride(i))), reverse=True)
    return "".join(dims[i] for i in ranked)


def packed_kv_regions(name: str, cache: torch.Tensor, group: int, kind: str, total_kv_heads: int
                      ) -> list[R.Region]:
    """vLLM 0.34's per-layer view: logical ``[B, H, N, C]`` with K||V in C, laid out in
    memory as the engine's ``KVCacheLayout`` says (LBHNC, BLHNC: heads outside tokens;
    LBNHC, BLNHC: heads inside tokens; LHBNC, BHLNC: a block's heads not adjacent). Read
    from the strides, never assumed: a block's ``[H, N, C]`` must be one contiguous run,
    HND (per-head units, sliceable across TP) or NHD (whole blocks only, equal TP); any
    other order is refused here, naming it."""
    heads, tokens, channels = (int(n) for n in cache.shape[1:])
    s_h, s_n, s_c = (int(cache.stride(i)) for i in (1, 2, 3))
    elem = int(cache.element_size())
    head_bytes = tokens * channels * elem
    contiguous_c = s_c == 1 or channels == 1
    hnd = contiguous_c and s_n == channels and (s_h == tokens * channels or heads == 1)
    nhd = contiguous_c and s_h == channels and (s_n == heads * channels or tokens == 1)
    outer = int(cache.stride(0)) >= heads * head_bytes // elem or int(cache.shape[0]) == 1
    if not outer or not (hnd or nhd):
        raise R.RegionError(
            f"{name}: KV cache memory order {physical_order(cache, 'BHNC')} (strides "
            f"B,H,N,C = {tuple(int(x) for x in cache.stride())}): a block's [H, N, C] is not one "
            "contiguous run, so it cannot be moved per block; start the engine with an "
            "HND layout (VLLM_KV_CACHE_LAYOUT=LBHNC, the connector's default request) or "
            "NHD (LBNHC) at equal TP sizes")
    return R.attention_packed_kv(layer=name, group=group, kind=kind, base=cache.data_ptr(),
                                 block_stride=_nbytes_stride(cache, 0),
                                 num_blocks=int(cache.shape[0]), heads=heads,
                                 global_heads=total_kv_heads, head_bytes=head_bytes,
                                 interleaved=not hnd)


def mla_regions(name: str, cache: torch.Tensor, spec: Any, group: int) -> list[R.Region]:
    _require_run(cache[0], name, "one block of the latent cache")
    return R.mla(layer=name, group=group, base=cache.data_ptr(),
                 block_stride=_nbytes_stride(cache, 0), num_blocks=int(cache.shape[0]),
                 page_bytes=int(spec.page_size_bytes))


def _mamba_state_facts(spec: Any, conv_layout: str) -> tuple[int, int, int, int, int]:
    """(channels, state_len, conv elem bytes, ssm heads, ssm head bytes) from a MambaSpec.

    Used for 0.34, whose Mamba cache is one int8 page per block (the layer splits it).
    Spec shapes are in vLLM's storage order for the selected conv layout.
    """
    (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = spec.shapes[:2], spec.dtypes[:2]
    if conv_layout == "DS":
        channels, state_len = conv_shape
    else:
        state_len, channels = conv_shape
    ssm_head_bytes = ssm_dtype.itemsize
    for dim in ssm_shape[1:]:
        ssm_head_bytes *= int(dim)
    return int(channels), int(state_len), conv_dtype.itemsize, int(ssm_shape[0]), ssm_head_bytes


def mamba_regions(name: str, cache: torch.Tensor, spec: Any, group: int, tp_size: int,
                  conv_layout: str, conv_split: R.ConvSplit | None) -> list[R.Region]:
    """<= 0.22: ``[conv, ssm]`` views into one page; 0.34: one int8 page tensor."""
    if isinstance(cache, (list, tuple)) and len(cache) == 2:
        conv, ssm = cache
        if conv_layout == "DS":
            channels, state_len = int(conv.shape[1]), int(conv.shape[2])
        else:
            state_len, channels = int(conv.shape[1]), int(conv.shape[2])
        elem, ssm_heads = int(conv.element_size()), int(ssm.shape[1])
        ssm_head_bytes = int(ssm[0, 0].numel() * ssm.element_size())
        _require_run(conv[0], name, "one block's conv state")
        _require_run(ssm[0], name, "one block's ssm state")
        conv_bytes = int(conv[0].numel()) * elem
        if (ssm.data_ptr() - conv.data_ptr() != conv_bytes
                or _nbytes_stride(ssm, 0) != _nbytes_stride(conv, 0)):
            raise R.RegionError(
                f"{name}: the ssm state starts {ssm.data_ptr() - conv.data_ptr()} bytes "
                f"after the conv state (expected {conv_bytes}: right after it in one page) "
                f"or pages differ ({_nbytes_stride(ssm, 0)} vs {_nbytes_stride(conv, 0)} "
                "bytes); this Mamba page layout is not supported")
        base, block_stride, num_blocks = conv.data_ptr(), _nbytes_stride(conv, 0), conv.shape[0]
    elif hasattr(cache, "data_ptr"):
        channels, state_len, elem, ssm_heads, ssm_head_bytes = _mamba_state_facts(
            spec, conv_layout)
        base, block_stride, num_blocks = cache.data_ptr(), _nbytes_stride(cache, 0), \
            cache.shape[0]
    else:
        raise R.RegionError(f"{name}: expected the [conv, ssm] state views or one page "
                            "tensor of a Mamba layer")
    split = conv_split or R.ConvSplit((("conv", channels, channels * tp_size),))
    if split.channels != channels:
        raise R.RegionError(f"{name}: conv split covers {split.channels} channels, the state "
                            f"has {channels}")
    return R.mamba(layer=name, group=group, base=base, block_stride=block_stride,
                   num_blocks=int(num_blocks), conv_layout=conv_layout, conv_split=split,
                   conv_state_len=state_len, conv_elem_bytes=elem, ssm_heads=ssm_heads,
                   ssm_global_heads=ssm_heads * tp_size, ssm_head_bytes=ssm_head_bytes,
                   page_bytes=int(spec.page_size_bytes))


def regions_for_kv_caches(kv_caches: dict[str, torch.Tensor],
                          kv_cache_config: KVCacheConfigLike, tp_size: int,
                          total_kv_heads: int, conv_layout: str,
                          conv_split: R.ConvSplit | None = None,
                          attention_dims: dict[int, str | None] | None = None
                          ) -> list[R.Region]:
    """Regions of every layer vLLM registered, in KV cache group order.
    ``attention_dims``: per attention group, what its backend declares."""
    out: list[R.Region] = []
    for group_index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = spec_kind(spec)
        for name in group.layer_names:
            cache = kv_caches[name]
            if kind is SpecKind.MAMBA:
                out += mamba_regions(name, cache, spec, group_index, tp_size, conv_layout,
                                     conv_split)
            elif kind is SpecKind.MLA:
                out += mla_regions(name, cache, spec, group_index)
            else:
                out += attention_regions(name, cache, spec, group_index, tp_size,
                                         total_kv_heads,
                                         (attention_dims or {}).get(group_index))
    return out
