"""Handshake messages between a prefill (P) and a decode (D) worker, and their checks.

Two layers, as NIXL learned to do: a protocol version first (what schema follows), then a
compatibility hash over *layout facts only*: model, dtype, KV cache dtype (fp8 variant
included), per-group spec kind, block size, page bytes, conv layout. The vLLM version string
is deliberately not hashed, so a Hygon ``0.20.0+das`` prefill pairs with a MetaX ``0.20.2``
decode. When the hashes differ, the fact sheets are compared field by field, so the error
names the field and both values. TP sizes are exchanged, not hashed: D learns P's TP
itself instead of trusting a router.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from vllm_flagcx.layout.regions import Region
from vllm_flagcx.wire.params import TransferId

# 2: LayoutFacts.cache_format; 3: no byte sample where the reply carries the digests
PROTOCOL_VERSION = 3


UNKNOWN_FORMAT = "unknown"


class HandshakeError(ValueError):
    """P and D cannot pair, or a handshake message is malformed."""


class LayoutFacts(msgspec.Struct, frozen=True):
    """What must be equal on P and D for bytes to mean the same thing."""

    model: str
    dtype: str
    kv_cache_dtype: str
    group_kinds: tuple[str, ...]
    block_sizes: tuple[int, ...]
    kernel_block_sizes: tuple[int, ...]
    page_bytes: tuple[int, ...]
    conv_layout: str
    num_kv_heads: int
    # The attention kernel's storage format: backend, CPU ISA (vLLM's AMX cache is
    # pre-packed: same shapes, other byte order), stride order and layout
    # (``compat.attention.cache_format``). Two sides that differ here cannot share bytes.
    cache_format: str = UNKNOWN_FORMAT


class FactSheet(msgspec.Struct, frozen=True):
    """Everything one worker advertises: layout facts, topology, regions, transport."""

    protocol_version: int
    engine_id: str
    incarnation: str  # changes on every restart: cached peers from before are stale
    layout: LayoutFacts
    compat_hash: str
    tp_size: int
    tp_rank: int
    pp_size: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    transport: str = ""
    transport_desc: bytes = b""
    regions: tuple[Region, ...] = ()


class HandshakeRequest(msgspec.Struct, frozen=True, tag="hello"):
    protocol_version: int
    tp_rank: int  # which P rank's sheet D wants


class HandshakeReply(msgspec.Struct, frozen=True, tag="sheet"):
    sheet: FactSheet


class HandshakeRefused(msgspec.Struct, frozen=True, tag="refused"):
    reason: str


class PullRequest(msgspec.Struct, frozen=True, tag="pull"):
    """D asks one P rank to write ``transfer_id`` into these blocks (per KV cache group)."""

    transfer_id: TransferId
    sheet: FactSheet  # the receiver's sheet: regions, TP, transport description
    block_ids: tuple[tuple[int, ...], ...]
    offsets: tuple[int | None, ...] = ()  # per group: local prefix hit in blocks, or tails


class PullReply(msgspec.Struct, frozen=True, tag="pulled"):
    """Per-request status: one reply per pull, never one status byte per batch."""

    transfer_id: TransferId
    ok: bool
    error: str = ""
    num_bytes: int = 0
    num_descriptors: int = 0
    sample: tuple[tuple[int, int], ...] = ()  # receiver ranges of the integrity sample
    sample_crc: int = 0
    # (layer, 64-bit digest) of everything this rank wrote (layout.digest), per layer
    digests: tuple[tuple[str, int], ...] = ()
    # prefill's own seconds inside this answer: (queued before the write, the write, the
    # integrity checks, of which the digest); its clock only (wire.timeline)
    timings: tuple[float, ...] = ()


class Release(msgspec.Struct, frozen=True, tag="release"):
    """D no longer needs ``transfer_id`` (aborted, or fully hit locally): free it."""

    transfer_id: TransferId


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """D still intends to pull these transfers: P renews their leases."""

    transfer_ids: tuple[TransferId, ...]


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    transfer_id: str  # what was acknowledged (a heartbeat's ids, joined and capped)


Message = (HandshakeRequest | HandshakeReply | HandshakeRefused | PullRequest | PullReply
           | Release | Heartbeat | Ack)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def compat_hash(layout: LayoutFacts) -> str:
    """sha256 over the layout facts (and the protocol version), never the vLLM version."""
    payload = msgspec.msgpack.encode((PROTOCOL_VERSION, layout))
    return hashlib.sha256(payload).hexdigest()


def make_sheet(*, layout: LayoutFacts, engine_id: str, incarnation: str, tp_size: int,
               tp_rank: int, **kwargs: Any) -> FactSheet:
    return FactSheet(protocol_version=PROTOCOL_VERSION, engine_id=engine_id,
                     incarnation=incarnation, layout=layout, compat_hash=compat_hash(layout),
                     tp_size=tp_size, tp_rank=tp_rank, **kwargs)


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)


def decode(data: bytes) -> Message:
    """Decode a side-channel message; anything else raises ``HandshakeError``."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeError(f"malformed handshake message ({len(data)} bytes): {exc}") from exc


def check_compatible(local: FactSheet, remote: FactSheet, *, skip_hash: bool = False) -> None:
    """Raise ``HandshakeError`` naming the first differing fact and both values.

    ``skip_hash`` (extra config ``enforce_handshake_compat: false``) is the escape hatch
    for operators who know two layouts are byte-compatible although their facts differ.
    """
    if remote.protocol_version != local.protocol_version:
        raise HandshakeError(
            f"protocol_version: local {local.protocol_version}, remote "
            f"{remote.protocol_version}; upgrade vllm-flagcx on both instances to the same "
            "release")
    if skip_hash:
        return
    for side, sheet in (("local", local), ("remote", remote)):
        if sheet.layout.cache_format in ("", UNKNOWN_FORMAT):
            raise HandshakeError(
                f"cache_format of engine {sheet.engine_id!r} ({side}) is unknown: the "
                "attention kernel's storage format could not be read, and bytes of an "
                "unknown format are never moved. Run `vllm-flagcx doctor` there (or set "
                "kv_connector_extra_config.enforce_handshake_compat=false if you know both "
                "layouts are byte-compatible)")
    expected = compat_hash(remote.layout)
    if remote.compat_hash != expected:
        raise HandshakeError(f"compat_hash of the remote sheet is {remote.compat_hash}, its "
                             f"facts hash to {expected}: the sheet was altered or corrupted")
    if remote.compat_hash == local.compat_hash:
        return
    for field in LayoutFacts.__struct_fields__:
        mine, theirs = getattr(local.layout, field), getattr(remote.layout, field)
        if mine != theirs:
            raise HandshakeError(
                f"incompatible peers: {field} is {mine!r} on engine {local.engine_id!r} and "
                f"{theirs!r} on engine {remote.engine_id!r}; start both instances with the "
                "same value (or set "
                "kv_connector_extra_config.enforce_handshake_compat=false if you know the "
                "layouts are byte-compatible)")
    raise HandshakeError("compat_hash differs but no layout fact does")  # pragma: no cover
