"""What prefill keeps of decode's pulls: each pull's fields checked before any plan is made
(``pull_problem``), each receiver rank pinned as its incarnation's first pull named it, with
the plan table to it and the storages every descriptor must write inside
(``ReceiverCache``), and the pulls that wait for their transfer to be armed or for a free
writer (``ParkedPulls``).

Pinning is the defence against a pull that names memory of another process: a later pull
of the same incarnation and rank that names other regions, or another transport, is
refused, and ``bounds.check_within`` holds each descriptor to the pinned storages.

Why parked pulls are bounded three ways: a pull for an unknown transfer id costs nothing to
send, so strangers (or one captured pull replayed) could fill a plain count cap and make
prefill refuse the real decode's pulls (measured: 1,024 bare pulls per lease failed 143 of
342 PD requests), or fill memory (64 parked pulls with large sheets: +975 MB). So:

* the server claims BEFORE it parks (``prefill.server``): a pull for an armed
  transfer is written or answered at once, and only pulls that must wait come here;
* an identical pull (same transfer, same receiver incarnation and rank) replaces the
  one parked before it: a replayed frame takes one slot, however often it arrives;
* pulls for transfers not armed yet are capped in count, in bytes and per decode engine;
  pulls for armed transfers waiting for a writer (``busy``) are capped apart, so
  strangers never push them out.

Thread-safe: the side-channel thread parks and drains; each owner here takes its own lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_flagcx.connector.prefill.gate import PeerCred
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
    spans: tuple[tuple[int, int], ...]


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
            spans = tuple(storage_spans(regions))
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


MAX_PARKED_PULLS = 1024  # pulls for transfers not armed yet
MAX_PARKED_BYTES = 64 << 20  # their encoded size
MAX_PARKED_PER_ENGINE = 256  # of them, from one decode engine id
MAX_BUSY_PULLS = 4096  # pulls for armed transfers, waiting for a free writer


@dataclass
class ParkedPull:
    ident: bytes
    pull: hs.PullRequest
    deadline: float
    size: int
    armed: bool  # its transfer was armed when it parked (waits for a writer)
    peer: PeerCred | None = None  # the kernel's record of a Unix-socket sender

    @property
    def key(self) -> tuple[str, str, int]:
        return self.pull.transfer_id, self.pull.sheet.incarnation, self.pull.sheet.tp_rank


class ParkedPulls:
    """The parked pulls of one prefill rank (see the module docstring)."""

    def __init__(self, max_pulls: int = MAX_PARKED_PULLS, max_bytes: int = MAX_PARKED_BYTES,
                 max_per_engine: int = MAX_PARKED_PER_ENGINE,
                 max_busy: int = MAX_BUSY_PULLS) -> None:
        self._lock = threading.Lock()
        self._pulls: dict[tuple[str, str, int], ParkedPull] = {}
        self._limits = (max_pulls, max_bytes, max_per_engine, max_busy)

    def __len__(self) -> int:
        return len(self._pulls)

    def park(self, entry: ParkedPull) -> tuple[str | None, bytes | None]:
        """(refusal naming the cap that is full, or None; the ident of an identical pull
        this one replaced, to be answered, or None)."""
        max_pulls, max_bytes, max_per_engine, max_busy = self._limits
        with self._lock:
            replaced = self._pulls.pop(entry.key, None)
            same_kind = [p for p in self._pulls.values() if p.armed == entry.armed]
            if entry.armed:
                if len(same_kind) >= max_busy:
                    return self._restore(replaced, f"more than {max_busy} pulls wait for a "
                                         "writer here")
            else:
                engine = entry.pull.sheet.engine_id
                per_engine = Counter(p.pull.sheet.engine_id for p in same_kind)
                if len(same_kind) >= max_pulls:
                    return self._restore(replaced, f"more than {max_pulls} pulls wait here "
                                         "for transfers not armed yet")
                if sum(p.size for p in same_kind) + entry.size > max_bytes:
                    return self._restore(replaced, f"parked pulls would exceed {max_bytes} "
                                         "bytes here")
                if per_engine[engine] >= max_per_engine:
                    return self._restore(replaced, f"more than {max_per_engine} pulls of "
                                         f"engine {engine[:64]!r} wait here")
            self._pulls[entry.key] = entry
            return None, replaced.ident if replaced is not None else None

    def _restore(self, replaced: ParkedPull | None, why: str) -> tuple[str, None]:
        if replaced is not None:
            self._pulls[replaced.key] = replaced
        return why, None

    def take_all(self) -> list[ParkedPull]:
        with self._lock:
            pulls, self._pulls = list(self._pulls.values()), {}
        return pulls

    def put_back(self, pulls: list[ParkedPull]) -> list[bytes]:
        """Return pulls that must still wait; one parked meanwhile under the same key is
        newer and wins: the idents of those it replaced, to be answered."""
        superseded = []
        with self._lock:
            for entry in pulls:
                if self._pulls.setdefault(entry.key, entry) is not entry:
                    superseded.append(entry.ident)
        return superseded
