"""Decode-side lease renewal: heartbeats for transfers decode will pull but has not yet.

A decode request can wait in decode's queue (no free blocks) long after prefill finished.
Prefill holds its blocks only for a lease; this thread, in the decode scheduler process,
renews the lease of every awaited transfer every ``interval`` seconds, on every prefill
rank, until the request is allocated (then the pull itself takes over) or ends. Which
transfers are awaited is not kept here: ``targets`` asks their owner (decode's
``connector.decode.loads.Loads``) each round. ``wake`` beats the ones not beaten yet at
once: that first word turns prefill's short first lease into the full one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

from vllm_flagcx.wire import client
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.params import RemotePrefill, TransferId

logger = logging.getLogger("vllm_flagcx")


class HeartbeatSender:
    def __init__(self, interval: float, targets: Callable[[], Iterable[RemotePrefill]],
                 timeout: float = 1.0, key: bytes | None = None) -> None:
        self.interval = interval
        self.key = key  # the side-channel secret's MAC key (``auth.load_key``)
        self.timeout = timeout
        self._awaited = targets  # thread-safe: called from the heartbeat thread
        self._beaten: set[TransferId] = set()  # of the last round (heartbeat thread)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channels: client.Channels | None = None  # kept connections, made at first use
        self.sent = 0

    def wake(self) -> None:
        """A transfer became awaited: beat the new ones now (starts the thread once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="flagcx-heartbeat")
                self._thread.start()
        self._wake.set()

    def _targets(self, fresh_only: bool = False
                 ) -> dict[tuple[str, int, int], list[TransferId]]:
        awaited = list(self._awaited())
        ids = {remote.transfer_id for remote in awaited}
        if fresh_only:
            awaited = [r for r in awaited if r.transfer_id not in self._beaten]
            self._beaten |= ids
        else:
            self._beaten = ids
        out: dict[tuple[str, int, int], list[TransferId]] = defaultdict(list)
        for remote in awaited:
            out[(remote.remote_host, remote.remote_port, remote.remote_tp_size)].append(
                remote.transfer_id)
        return out

    def beat_once(self, fresh_only: bool = False) -> None:
        """One round of heartbeats (the thread calls this every ``interval``, and for the
        new ones alone when woken)."""
        import zmq

        with self._lock:  # one kept connection per prefill rank
            if self._channels is None:
                self._channels = client.Channels(zmq.Context.instance())
            channels = self._channels
        for (host, port, tp), tids in self._targets(fresh_only).items():
            for rank in range(tp):
                try:
                    channels.ask(host, port + rank, hs.Heartbeat(tuple(tids)),
                                       self.timeout, key=self.key)
                    self.sent += 1
                except (TimeoutError, OSError, zmq.ZMQError, hs.HandshakeError) as exc:
                    logger.debug("heartbeat to %s:%d failed: %s", host, port + rank, exc)

    def _run(self) -> None:
        next_round = time.monotonic() + self.interval
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, next_round - time.monotonic()))
            if self._stop.is_set():
                return
            if woken:
                self._wake.clear()
            if time.monotonic() >= next_round:
                self.beat_once()
                next_round = time.monotonic() + self.interval
            elif woken:
                self.beat_once(fresh_only=True)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.timeout + self.interval)
        if self._channels is not None:
            self._channels.close()
