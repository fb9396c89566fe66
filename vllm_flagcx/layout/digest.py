"""The full logical digest of a transfer: one 64-bit number per layer over EVERY element
the transfer is meant to deliver, keyed by what each element means (pure: numpy only).

Why: a sample (a few keys per layer) passes a plan that is wrong narrowly (16 bytes of
token 0 left behind, blocks 1 and 3 swapped, two conv sections swapped) and saw no Mamba
state at all. Each side computes this digest from its OWN view of its own cache (the
tensors vLLM registered, through their own indexing: ``compat.kv_views``), never from
regions or plans, so a plan that names the wrong bytes cannot check itself.

The digest of a layer is a random linear form over its elements, mod 2**64::

    D = sum over (part, row, token, word) of a[part, row] * b[token] * c[word] * X

``X`` is one word (8, 4, 2 or 1 bytes, sign-extended) of a row's bytes in logical order;
a row is one unit a TP rank holds whole (a KV head's channels at one token, one conv
channel's history, one ssm head's state), and ``row`` is its GLOBAL index, so neither the
memory order nor the TP split changes it. ``token`` is the element's position in the
transfer (attention: pair index * block size + slot; state: the pair index). The weights
are odd pseudo-random numbers (splitmix64 of the coordinate and a per-(layer, part)
salt): a single wrong word changes D (odd times non-zero is non-zero mod 2**64); two
elements exchanged change it unless their weight difference times their value
difference vanishes mod 2**64 (about one chance in 2**60 for unrelated values).

``reference`` computes D from canonical numpy arrays; the torch path (``compat``) must
equal it bit for bit, on any device.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from vllm_flagcx.layout.topology import head_range, target_remote_ranks

MASK = (1 << 64) - 1
TOKEN_SALT = 0x9E3779B97F4A7C15
WORD_SALT = 0xD1B54A32D192ED03


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (numpy's uint64 arithmetic wraps), made odd."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) | np.uint64(1)


def weights(salt: int, count: int, start: int = 0) -> np.ndarray:
    """Odd uint64 weights of coordinates ``start .. start + count - 1``."""
    coords = np.arange(start, start + count, dtype=np.uint64)
    return _mix(coords ^ np.uint64(salt & MASK))


@functools.lru_cache(maxsize=8192)
def salt(layer: str, part: str) -> int:
    """A stable 64-bit salt per (layer, part): one layer's rows never stand in for
    another's, nor K for V. Cached: both sides ask for every part on every pull."""
    return int.from_bytes(hashlib.blake2b(f"{layer}\0{part}".encode(), digest_size=8)
                          .digest(), "little")


def word_bytes(row_bytes: int) -> int:
    """The widest word (8, 4, 2, 1 bytes) that tiles a row: both sides hold the same
    dtype and row width, so both group a row's bytes the same way."""
    return next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)


def words(rows: np.ndarray) -> np.ndarray:
    """(tokens, rows, row bytes) uint8 -> (tokens, rows, words) uint64, sign-extended."""
    width = word_bytes(rows.shape[-1])
    signed = np.ascontiguousarray(rows).view(f"<i{width}")
    return signed.astype(np.int64).view(np.uint64)


def reference(parts: Mapping[str, tuple[np.ndarray, int]], layer: str) -> int:
    """D of one layer from canonical arrays: ``parts[name] = (bytes, first global row)``
    with bytes shaped (tokens, rows, row bytes), uint8."""
    total = 0
    for name, (raw, first_row) in parts.items():
        x = words(raw)
        t, r, w = x.shape
        if not x.size:
            continue
        with np.errstate(over="ignore"):
            per_row = (x * weights(WORD_SALT, w)).sum(axis=2, dtype=np.uint64)
            per_row = (per_row * weights(TOKEN_SALT, t)[:, None]).sum(axis=0,
                                                                     dtype=np.uint64)
            total += int((per_row * weights(salt(layer, name), r, first_row))
                         .sum(dtype=np.uint64))
    return total & MASK


@functools.lru_cache(maxsize=4096)
def written_units(sender: tuple[int, int], receiver: tuple[int, int], units: int,
                  replicated: bool = False) -> range:
    """The global units (KV heads, conv channels, ssm heads) sender rank ``sender[0]`` of
    TP ``sender[1]`` writes into receiver rank ``receiver[0]`` of TP ``receiver[1]``: what
    both sides' digests of that pair cover. The writer choice is the plan's
    (``target_remote_ranks``: one sender per replicated range); ``covers_receiver`` checks
    that the senders' ranges tile the receiver's."""
    chosen = target_remote_ranks(receiver[0], receiver[1], sender[1], units, replicated)
    if sender[0] not in chosen:
        return range(0)
    if replicated:
        return range(units)
    s, r = head_range(sender[0], sender[1], units), head_range(receiver[0], receiver[1], units)
    return range(max(s[0], r[0]), max(max(s[0], r[0]), min(s[1], r[1])))


@functools.lru_cache(maxsize=1024)
def covers_receiver(sender_tp: int, receiver: tuple[int, int], units: int,
                    replicated: bool = False) -> bool:
    """Every unit the receiver rank holds is written by exactly one sender rank."""
    got = sorted(u for p in range(sender_tp)
                 for u in written_units((p, sender_tp), receiver, units, replicated))
    want = list(range(units)) if replicated else list(range(*head_range(*receiver, units)))
    return got == want


def refuse(digests: Sequence[tuple[str, int]], expected: Mapping[str, int]) -> str | None:
    """Why a reply's digests (they came from the peer) must not be compared, or None:
    each layer at most once, only layers this side computed, 64-bit values."""
    if len(digests) > len(expected):
        return (f"{len(digests)} integrity digests in one reply, this rank registered "
                f"{len(expected)} layers that receive bytes")
    seen: set[str] = set()
    for layer, value in digests:
        if layer not in expected:
            return f"integrity digest names layer {layer!r}, not one this request receives"
        if layer in seen or not 0 <= value <= MASK:
            return f"integrity digest of {layer!r} repeated or not a 64-bit value"
        seen.add(layer)
    return None


def mismatch(digests: Sequence[tuple[str, int]], expected: Mapping[str, int],
             groups: Mapping[str, int]) -> str | None:
    """Decode: where the reply's digests and this side's differ, named by KV cache group
    and layer range; None when every layer this request receives matches."""
    refusal = refuse(digests, expected)
    if refusal is not None:
        return refusal
    got = dict(digests)
    missing = [name for name in expected if name not in got]
    if missing:
        return (f"no integrity digest for {len(missing)} layer(s) from {missing[0]} on: the "
                "load is unproven (is verify_integrity false on prefill?)")
    wrong = [name for name in expected if got[name] != expected[name]]
    if not wrong:
        return None
    by_group: dict[int, list[str]] = {}
    for name in wrong:
        by_group.setdefault(groups[name], []).append(name)
    named = "; ".join(f"KV cache group {g}: {len(ns)} layer(s) {ns[0]} .. {ns[-1]}"
                      for g, ns in sorted(by_group.items()))
    return (f"integrity digest differs ({named}): decode holds other data than prefill "
            "sent (the transfer plan named the wrong bytes, or bytes were lost)")
