"""Prefill's view of the decode ranks that pull from it: each pull's fields checked before
any plan is made (``pull_problem``), and each receiver rank pinned as its incarnation's first
pull named it, with the plan table to it and the storages every descriptor must write
inside (``ReceiverCache``).

Pinning is the defence against a pull that names memory of another process: a later pull
of the same incarnation and rank that names other regions, or another transport, is
refused, and ``bounds.check_within`` holds each descriptor to the pinned storages.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_flagcx.layout import plans
from vllm_flagcx.layout.regions import Region, storage_spans
from vllm_flagcx.wire import handshake as hs

MAX_TP = 1024
MAX_RECEIVERS = 256  # (incarnation, rank) pairs kept; decode restarts make new ones


def pull_problem(pull: hs.PullRequest, num_groups: int) -> str:
    """What makes a pull unservable before any plan is made ("" when nothing): the
    receiver's TP rank and size, the group count and the block ids it names (a pull
    crosses a process boundary: its fields are untrusted)."""
    sheet = pull.sheet
    if not 1 <= sheet.tp_size <= MAX_TP or not 0 <= sheet.tp_rank < sheet.tp_size:
        return (f"receiver tp_rank {sheet.tp_rank} / tp_size {sheet.tp_size} is not a TP "
                "position")
    if len(pull.block_ids) != num_groups:
        return f"{len(pull.block_ids)} block-id groups named, this model has {num_groups}"
    if pull.offsets and len(pull.offsets) != num_groups:
        return f"{len(pull.offsets)} offsets named, this model has {num_groups} groups"
    if any(b < 0 or b >= 1 << 31 for group in pull.block_ids for b in group):
        return "a block id outside 0 .. 2**31"
    return ""


@dataclass(frozen=True)
class Receiver:
    """A decode rank as its incarnation's first pull named it: its sheet (regions and the
    process written into), the request-independent plan table to it, and the storages
    every descriptor must write inside."""

    sheet: hs.FactSheet
    table: plans.PlanTable
    spans: list[tuple[int, int]]


class ReceiverCache:
    """Receivers by (incarnation, rank), built once each (as NIXL builds its descriptor
    lists at the handshake, so a pull only computes block addresses). Thread-safe: writer
    threads look receivers up concurrently."""

    def __init__(self, tp_rank: int, tp_size: int, num_groups: int) -> None:
        self._tp_rank, self._tp_size, self._num_groups = tp_rank, tp_size, num_groups
        self._lock = threading.Lock()
        self._known: dict[tuple[str, int], Receiver] = {}

    def __len__(self) -> int:
        return len(self._known)

    def get(self, sheet: hs.FactSheet, local_regions: Sequence[Region]) -> Receiver:
        """The receiver ``sheet`` names, pinned at its first pull; HandshakeError when a
        later pull of the same incarnation and rank names other regions or transport. A
        sheet whose plan table cannot be built raises and is not pinned."""
        key = (sheet.incarnation, sheet.tp_rank)
        with self._lock:
            known = self._known.get(key)
        if known is None:
            pair = plans.RankPair(self._tp_rank, self._tp_size, sheet.tp_rank, sheet.tp_size)
            regions = list(sheet.regions)
            spans = storage_spans(regions)
            table = plans.build_table(local_regions, regions, pair,
                                      num_groups=self._num_groups,
                                      sender_spans=storage_spans(local_regions),
                                      receiver_spans=spans)
            built = Receiver(sheet, table, spans)
            with self._lock:
                if len(self._known) >= MAX_RECEIVERS:  # decode restarts: drop stale ones
                    self._known.clear()
                known = self._known.setdefault(key, built)
        if known.sheet != sheet:
            raise hs.HandshakeError(f"receiver incarnation {sheet.incarnation!r} rank "
                                    f"{sheet.tp_rank} names other regions or another "
                                    "transport than at its first pull")
        return known
