"""The data path behind one small interface, so connector logic is written once.

register memory once per unique storage, describe it (bytes advertised in the handshake),
connect to a peer's description (cached by the caller, invalidated on error), write a
batch by address (numpy arrays, never Python lists on the hot path) with a result that can
fail, close.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np


class TransportError(RuntimeError):
    """A transport operation failed; the message names the operation and the peer."""


@dataclass(frozen=True)
class WriteResult:
    ok: bool
    error: str = ""
    num_bytes: int = 0


class Transport(abc.ABC):
    name: str = "abstract"
    # Writes the prefill side may issue at once from its writer threads. 1 unless the
    # transport is known to be thread-safe (FlagCX's engine is not documented as such).
    max_concurrent_writes: int = 1

    @abc.abstractmethod
    def register(self, address: int, size: int) -> None:
        """Make [address, address+size) reachable by peers (once per unique storage)."""

    @abc.abstractmethod
    def describe(self) -> bytes:
        """What a peer needs to connect to this endpoint (sent in the handshake)."""

    @abc.abstractmethod
    def connect(self, peer: bytes) -> object:
        """A handle for writing into the peer described by ``peer``."""

    def peer_pid(self, peer: bytes) -> int | None:
        """The process on this host that writes to ``peer`` would land in (same-host
        transports), for the side channel to check it is the one asking; None when the
        transport writes through something else (RDMA, a library's own endpoint)."""
        return None

    @abc.abstractmethod
    def write(self, handle: object, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
              src_hint: np.ndarray | None = None,
              dst_hint: np.ndarray | None = None) -> WriteResult:
        """Copy ``length[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``.

        ``src_hint`` / ``dst_hint``: per descriptor, the index (in registration order) of
        the range of this side / the peer that probably holds it (a plan names each
        descriptor's storage span: ``layout.plans.TransferPlan``). A transport may use
        them to skip its own search, and must still check every descriptor."""

    def disconnect(self, handle: object) -> None:
        """Forget a cached connection (after an error, or when a peer restarted)."""
        return None

    def close(self) -> None:
        """Release everything registered and connected."""
        return None
