"""Pulls that wait on prefill for their transfer to be armed, or for a free writer.

Why bounded three ways: a pull for an unknown transfer id costs nothing to send, so
strangers (or one captured pull replayed) could fill a plain count cap and make prefill
refuse the real decode's pulls (measured: 1,024 bare pulls per lease failed 143 of 342
PD requests), or fill memory (64 parked pulls with large sheets: +975 MB). So:

* the server claims BEFORE it parks (``prefill.server``): a pull for an armed
  transfer is written or answered at once, and only pulls that must wait come here;
* an identical pull (same transfer, same receiver incarnation and rank) replaces the
  one parked before it: a replayed frame takes one slot, however often it arrives;
* pulls for transfers not armed yet are capped in count, in bytes and per decode engine;
  pulls for armed transfers waiting for a writer (``busy``) are capped apart, so
  strangers never push them out.

Thread-safe: the side-channel thread parks and drains, nothing else touches it.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from vllm_flagcx.connector.prefill.gate import PeerCred
from vllm_flagcx.wire import handshake as hs

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
