"""Attention backends and KV layout, across the 0.13 -> 0.34 moves.

* ``get_attn_backend`` moved from ``vllm.attention.selector`` to ``vllm.v1.attention.selector``
  and lost ``block_size`` in 0.18: a positional 0.13-style call then binds block_size to
  ``use_mla``. The wrapper is keyword-only and drops every kwarg the installed signature lacks.
* The backends in use: a list from 0.18, one backend in 0.17, a layer walk on 0.13.
* Layout: ``get_kv_cache_layout()`` ("NHD"/"HND") up to 0.22; 0.34 resolves a
  ``KVCacheLayout`` ("LBHNC"...) on the CacheConfig. ``HND`` == ``LBHNC``, ``NHD`` == ``LBNHC``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import resolve

# 0.34 layout names that have a legacy (<= 0.22) spelling.
_LEGACY_LAYOUT = {"LBHNC": "HND", "LBNHC": "NHD"}


def get_attn_backend(**kwargs: Any) -> Any:
    """``get_attn_backend`` called by keyword with only the kwargs this build accepts."""
    selector = resolve("get_attn_backend")
    params = inspect.signature(selector).parameters
    accepted = {k: v for k, v in kwargs.items() if k in params}
    return selector(**accepted)


def _dedup(backends: list[Any]) -> list[Any]:
    seen: dict[str, Any] = {}
    for backend in backends:
        name = getattr(backend, "full_cls_name", None)
        key = name() if callable(name) else f"{backend.__module__}.{backend.__qualname__}"
        seen.setdefault(key, backend)
    return list(seen.values())


def current_attn_backends(vllm_config: Any, layer_names: list[str] | None = None) -> list[Any]:
    """Distinct attention backend classes of the model's layers (or the default one)."""
    mode = capabilities().current_attn_backends
    with resolve("set_current_vllm_config")(vllm_config):
        if mode == "list":
            return list(resolve("get_current_attn_backends")(vllm_config, layer_names))
        if mode == "single":
            return [resolve("get_current_attn_backend")(vllm_config)]
        try:
            layers = resolve("get_layers_from_vllm_config")(
                vllm_config, resolve("AttentionLayerBase"), layer_names)
        except KeyError:  # 0.13 raises for names its forward context does not hold yet
            layers = {}
        if layers:
            return _dedup([layer.get_attn_backend() for layer in layers.values()])
        model = vllm_config.model_config
        return [get_attn_backend(
            head_size=model.get_head_size(), dtype=model.dtype,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype,
            block_size=vllm_config.cache_config.block_size, use_mla=model.use_mla)]


def kv_layout(vllm_config: Any) -> str | None:
    """The KV cache layout name: "HND"/"NHD" where it has one, else the 0.34 name.

    None when 0.34's engine core has not resolved the layout yet.
    """
    source = capabilities().kv_layout
    if source == "get_kv_cache_layout":
        with resolve("set_current_vllm_config")(vllm_config):
            return str(resolve("get_kv_cache_layout")())
    try:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    except ValueError:
        return None
    return _LEGACY_LAYOUT.get(layout.name, layout.name)


def required_kv_layout_name(is_mla: bool) -> str | None:
    """What ``get_required_kvcache_layout`` should answer: "HND" (accepted on every build,
    an alias of LBHNC on 0.34) for head-sliced transfers, nothing for MLA."""
    return None if is_mla else "HND"


def cache_format(vllm_config: Any, layer_names: list[str], block_size: int, head_size: int
                 ) -> str:
    """The attention kernel's storage format of these layers, as one comparable string:
    ``BACKEND[:isa=...][:stride=...][:dims=...][:layout=...]`` per distinct backend,
    "+"-joined (``dims``: the logical dimensions it declares, ``declared_dims``).

    What it captures that tensor shapes do not: vLLM's CPU attention picks an ISA per
    machine (``amx`` pre-packs the cache: same shape, other byte order; ``vec``,
    ``vec16``, ``neon``...), GPU backends their own stride order, and the HND/NHD layout.
    Two instances whose strings differ are refused at the handshake by name; "unknown"
    (nothing could be read) is refused too, never guessed.
    """
    try:
        backends = current_attn_backends(vllm_config, layer_names)
    except Exception as exc:  # a vendor build without a readable backend: refused, not guessed
        logging.getLogger("vllm_flagcx").warning(
            "FlagCXConnector: the attention backend of %d layers could not be read (%s: %s);"
            " cache_format is 'unknown' and peers will refuse this instance",
            len(layer_names), type(exc).__name__, exc)
        return "unknown"
    layout = kv_layout(vllm_config) or "unresolved"
    parts = set()
    for backend in backends:
        details = [str(backend.get_name())]
        try:
            isa = _cpu_attention_isa(backend, vllm_config, block_size, head_size)
        except Exception as exc:  # the build's own ISA choice failed here: unknown
            logging.getLogger("vllm_flagcx").warning(
                "FlagCXConnector: %s could not tell its CPU ISA (%s: %s); cache_format is "
                "'unknown' and peers will refuse this instance", details[0],
                type(exc).__name__, exc)
            return "unknown"
        if isa:
            details.append(f"isa={isa}")
        order = _stride_order(backend)
        if order:
            details.append(f"stride={order}")
        dims = declared_dims(backend)
        if dims:
            details.append(f"dims={dims}")
        details.append(f"layout={layout}")
        parts.add(":".join(details))
    return "+".join(sorted(parts)) or "unknown"


def _cpu_attention_isa(backend: Any, vllm_config: Any, block_size: int, head_size: int
                       ) -> str | None:
    """The ISA vLLM's CPU attention module picks for this dtype/block/head size (the same
    call its metadata builder makes), or None for backends without one."""
    module = sys.modules.get(getattr(backend, "__module__", ""), None)
    pick = getattr(module, "_get_attn_isa", None)
    if pick is None:
        return None
    kwargs = {"dtype": vllm_config.model_config.dtype, "block_size": block_size,
              "head_size": head_size,
              "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype)}
    params = inspect.signature(pick).parameters
    return str(pick(**{k: v for k, v in kwargs.items() if k in params}))


def _stride_order(backend: Any) -> str | None:
    get = getattr(backend, "get_kv_cache_stride_order", None)
    if get is None:
        return None
    try:
        return ",".join(str(i) for i in get())
    except (NotImplementedError, TypeError):
        return None


# Distinct sizes, so that the shape a backend declares names each of its dimensions.
_CONTRACT_PROBE = {"B": 1009, "N": 32, "H": 3, "D": 64}  # N: FLASH_ATTN wants 16 | N
ATTENTION_DIMS = frozenset({"2BNHD", "B2NHD", "2BHND", "B2HND"})


def declared_dims(backend: Any) -> str | None:
    """The logical dimensions of ``backend``'s KV cache, from its own
    ``get_kv_cache_shape``: a string over 2 (K/V), B (blocks), N (tokens), H (heads),
    D (head size), e.g. "2BNHD" (FLASH_ATTN), "B2NHD" (TRITON_ATTN, FLASHINFER), "2BHND"
    (CPU_ATTN). None when the backend declares something else (a packed or MLA cache) or
    cannot be asked; the caller then falls back to reading shapes, and says so."""
    get = getattr(backend, "get_kv_cache_shape", None)
    if get is None:
        return None
    p = _CONTRACT_PROBE
    try:
        shape = get(p["B"], p["N"], p["H"], p["D"])
    except Exception:  # a signature or a size this build's backend refuses
        return None
    letters = {2: "2", **{size: name for name, size in p.items()}}
    dims = "".join(letters.get(int(n), "?") for n in shape)
    return dims if dims in ATTENTION_DIMS else None


def layer_attention_dims(vllm_config: Any, layer_names: list[str]) -> str | None:
    """``declared_dims`` of the one backend these layers run on; None when they run on
    several, or it cannot be read (logged: regions then come from the tensor's shape)."""
    try:
        backends = current_attn_backends(vllm_config, layer_names)
    except Exception as exc:  # a vendor build without a readable backend
        logging.getLogger("vllm_flagcx").warning(
            "FlagCXConnector: the attention backend of %s could not be read (%s: %s); K/V "
            "regions come from the cache tensors' shapes", layer_names[:1],
            type(exc).__name__, exc)
        return None
    dims = {declared_dims(b) for b in backends}
    return dims.pop() if len(dims) == 1 else None
