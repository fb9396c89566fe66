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
