"""The side channel's client half: one request, one answer, bounded by a timeout.

Decode's workers use it to handshake, pull and release; the router uses
``release_transfer`` to free what prefill holds for a client that went away after prefill
finished but before decode started (else the blocks wait for the lease to expire).
"""

from __future__ import annotations

from typing import Any

from vllm_flagcx.connector import handshake as hs


def ask(context: Any, host: str, port: int, message: hs.Message, timeout: float
        ) -> hs.Message:
    """Send ``message`` to ``host:port`` and return the answer; TimeoutError after
    ``timeout`` seconds without one."""
    import zmq

    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(hs.encode(message))
        return hs.decode(sock.recv())
    except zmq.error.Again as exc:
        raise TimeoutError(f"no answer from {host}:{port} within {timeout:.1f} s") from exc
    finally:
        sock.close()


def release_transfer(host: str, port: int, tp_size: int, transfer_id: str,
                     timeout: float = 2.0) -> list[str]:
    """Send ``Release(transfer_id)`` to prefill ranks ``port .. port+tp_size-1``; returns
    the errors (empty when every rank acknowledged)."""
    import zmq

    errors = []
    for rank in range(tp_size):
        try:
            reply = ask(zmq.Context.instance(), host, port + rank, hs.Release(transfer_id),
                        timeout)
            if not isinstance(reply, hs.Ack):
                errors.append(f"{host}:{port + rank}: answered {type(reply).__name__}")
        except (TimeoutError, OSError, zmq.ZMQError, hs.HandshakeError) as exc:
            errors.append(f"{host}:{port + rank}: {exc}")
    return errors
