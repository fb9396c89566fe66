"""client.ask against real ZMQ sockets on loopback: answers, timeouts, and a dead peer.

ZMQ reconnects to a dead peer silently, forever; without the probe, decode waited the
full pull timeout and then the release's (the lease), 70 s in the e2e run, for a prefill
that had been killed.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from testkit.router_standin import free_port

from vllm_flagcx.wire import client
from vllm_flagcx.wire import handshake as hs


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _silent_server(ctx, port):
    """A ROUTER that takes requests and never answers (a busy or frozen prefill)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock


def test_listening_tells_refused_from_accepting(context):
    port = free_port()
    assert client.listening("127.0.0.1", port) is False
    sock = _silent_server(context, port)
    try:
        assert client.listening("127.0.0.1", port) is True
    finally:
        sock.close()


def test_ask_returns_the_answer(context):
    port = free_port()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")

    def answer():
        if sock.poll(5000):
            ident, _, _ = sock.recv_multipart()
            sock.send_multipart([ident, b"", hs.encode(hs.Ack("t"))])

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        reply = client.ask(context, "127.0.0.1", port, hs.Release("t"), 5.0, probe_every=0.2)
        assert isinstance(reply, hs.Ack)
    finally:
        thread.join()
        sock.close()


def test_a_silent_but_alive_peer_is_waited_for_until_the_timeout(context):
    port = free_port()
    sock = _silent_server(context, port)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"no answer from 127.0.0.1:{port} within 1.0 s"):
            client.ask(context, "127.0.0.1", port, hs.Release("t"), 1.0, probe_every=0.2)
        assert time.monotonic() - started >= 0.9  # alive: not cut short by the probe
    finally:
        sock.close()


def test_a_peer_that_dies_while_asked_ends_the_wait_at_the_next_probe(context):
    port = free_port()
    sock = _silent_server(context, port)
    closer = threading.Timer(0.5, sock.close)
    closer.start()
    started = time.monotonic()
    with pytest.raises(client.PeerGoneError, match="refuses connections"):
        client.ask(context, "127.0.0.1", port, hs.Release("t"), 30.0, probe_every=0.2)
    assert time.monotonic() - started < 5
    closer.join()


def test_without_the_probe_a_dead_peer_costs_the_whole_timeout(context):
    port = free_port()
    with pytest.raises(TimeoutError):
        client.ask(context, "127.0.0.1", port, hs.Release("t"), 0.5)


class _Router:
    """A ROUTER that answers every request with an Ack, except the ``silent`` first ones;
    records each request's connection identity (one identity per TCP connection)."""

    def __init__(self, ctx, port, silent: int = 0):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.idents: list[bytes] = []
        self.silent = silent
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            if self.sock.poll(20):
                ident, _, _ = self.sock.recv_multipart()
                self.idents.append(ident)
                if self.silent:
                    self.silent -= 1
                    continue
                self.sock.send_multipart([ident, b"", hs.encode(hs.Ack("t"))])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_channels_keep_one_connection_per_peer(context):
    """Issue 27: a new connection (and, with a secret, a CURVE handshake) per message was
    the side channel's fixed cost; kept connections pay it once per peer."""
    port = free_port()
    server = _Router(context, port)
    channels = client.Channels(context)
    try:
        for _ in range(5):
            assert isinstance(channels.ask("127.0.0.1", port, hs.Release("t"), 5.0), hs.Ack)
        assert channels.opened == 1 and len(set(server.idents)) == 1
        assert len(server.idents) == 5
    finally:
        channels.close()
        server.close()


def test_a_connection_that_missed_its_answer_is_never_reused(context):
    """A REQ socket whose answer did not come is stuck: it is closed, and the next message
    goes over a new connection and is answered."""
    port = free_port()
    server = _Router(context, port, silent=1)
    channels = client.Channels(context)
    try:
        with pytest.raises(TimeoutError):
            channels.ask("127.0.0.1", port, hs.Release("t"), 0.3)
        assert isinstance(channels.ask("127.0.0.1", port, hs.Release("t"), 5.0), hs.Ack)
        assert channels.opened == 2 and len(set(server.idents)) == 2
    finally:
        channels.close()
        server.close()


def test_concurrent_askers_each_get_their_answer_and_the_pool_stays_bounded(context):
    port = free_port()
    server = _Router(context, port)
    channels = client.Channels(context, max_idle=2)
    answers: list[object] = []

    def asker():
        for _ in range(5):
            answers.append(channels.ask("127.0.0.1", port, hs.Release("t"), 5.0))

    try:
        threads = [threading.Thread(target=asker) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(answers) == 30 and all(isinstance(a, hs.Ack) for a in answers)
        assert 1 <= channels.opened <= 6 + 5 * 4  # reused across rounds, never more
        assert sum(len(c) for c in channels._idle.values()) <= 2
    finally:
        channels.close()
        server.close()
    with pytest.raises(ConnectionAbortedError, match="closed"):
        channels.ask("127.0.0.1", port, hs.Release("t"), 1.0)
