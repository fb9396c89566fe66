"""Which logical KV elements the integrity check compares, and whether a peer's choice is
one this side may read (pure: no vLLM, no torch).

Why logical: the byte sample (``connector.integrity``) checks that the bytes a plan named
arrived, so a plan that names the wrong bytes passes it (vLLM 0.34's NHD caches moved one
token per block with every check green). This check is keyed by what the bytes MEAN:
(layer, receiver's block, token inside the block, global KV head). Each side reads its
element through the tensor's own logical indexing (``compat.kv_views``), never through
regions or plans, and prefill's crc of each key must equal decode's.

The keys travel in prefill's reply, so decode checks every one before reading
(``refuse_keys``): a layer it registered, a block of this request, a token inside a block,
a head this rank holds, and no more keys than the sample ever has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

MAX_LAYERS = 4  # attention layers sampled per reply, spread over the model
KEYS_PER_LAYER = 8  # at least one per shared head when the rank holds more
MAX_KEYS = MAX_LAYERS * 16


class LogicalKey(NamedTuple):
    layer: str
    block: int  # the receiver's logical block id
    token: int  # token index inside that logical block
    head: int  # global KV head


class LayerFacts(NamedTuple):
    """What the check needs of one registered attention layer."""

    group: int
    block_size: int  # tokens per logical block (kernel block size x kernel ratio)
    global_heads: int


def shared_heads(a: tuple[int, int], b: tuple[int, int]) -> range:
    """Global heads both [start, stop) ranges hold."""
    return range(max(a[0], b[0]), min(a[1], b[1]))


def sample_keys(layers: Mapping[str, LayerFacts],
                pairs: Sequence[tuple[np.ndarray, np.ndarray]],
                heads: range, max_layers: int = MAX_LAYERS,
                keys_per_layer: int = KEYS_PER_LAYER
                ) -> list[tuple[LogicalKey, int]]:
    """(key, sender's block id) pairs spread over layers, blocks, tokens and heads.

    ``pairs[g]``: the (sender, receiver) logical block ids of group g, as the transfer
    pairs them (``plans.align_block_ids``). Every shared head appears in each sampled
    layer (up to 16 of them), tokens walk the block from its last slot with a stride that
    is not a multiple of common block sizes, so token 0 alone never suffices."""
    names = [n for n, f in layers.items() if len(pairs[f.group][1]) and len(heads)]
    if not names:
        return []
    picks = np.unique(np.linspace(0, len(names) - 1, min(max_layers, len(names))).astype(int))
    keys: list[tuple[LogicalKey, int]] = []
    for name in (names[i] for i in picks):
        facts = layers[name]
        senders, receivers = pairs[facts.group]
        count = min(max(keys_per_layer, len(heads)), 16)
        for k in range(count):
            pair = (k * len(receivers)) // count
            token = (facts.block_size - 1 + 5 * k) % facts.block_size
            keys.append((LogicalKey(name, int(receivers[pair]), token,
                                    heads[k % len(heads)]), int(senders[pair])))
    return keys


def refuse_keys(keys: Sequence[LogicalKey], layers: Mapping[str, LayerFacts],
                blocks: Sequence[Sequence[int]], own_heads: tuple[int, int],
                max_keys: int = MAX_KEYS) -> str | None:
    """Why decode must not read ``keys`` (they came from the peer), or None.

    ``blocks[g]``: this request's block ids of group g on this side."""
    if len(keys) > max_keys:
        return f"{len(keys)} logical integrity keys, at most {max_keys} are ever sent"
    allowed = [set(map(int, ids)) for ids in blocks]
    for key in keys:
        facts = layers.get(key.layer)
        if facts is None:
            return f"logical integrity key names layer {key.layer!r}, not one registered here"
        if facts.group >= len(allowed) or key.block not in allowed[facts.group]:
            return (f"logical integrity key names block {key.block} of {key.layer}, not one "
                    "of this request's blocks")
        if not 0 <= key.token < facts.block_size:
            return f"logical integrity key names token {key.token}, outside a block"
        if not own_heads[0] <= key.head < own_heads[1]:
            return (f"logical integrity key names KV head {key.head}, not one of this "
                    f"rank's heads {own_heads[0]}..{own_heads[1] - 1}")
    return None


def locate(block: int, token: int, ratio: int, kernel_block_size: int) -> tuple[int, int]:
    """(kernel block id, slot inside it) of ``token`` of logical block ``block`` when each
    logical block is ``ratio`` kernel blocks of ``kernel_block_size`` tokens."""
    return block * ratio + token // kernel_block_size, token % kernel_block_size
