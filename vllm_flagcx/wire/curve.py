"""The side channel's encryption with a secret: ZMQ CURVE, keys derived from that secret.

Why on top of the HMAC tag (``auth``): the tag authenticates each message but a server
still buffers whatever a stranger sends before it can check one (measured: 4 connections
of 48 x 15 MiB frames took prefill from 851 MB to 4 GB, handshakes to 3 s), a sniffed
sealed frame can be replayed (the handshake request is constant), and answers travel in
plain text (the sheet: pid, regions, CUDA IPC handles). CURVE authenticates the peer in
the connection's own handshake, before libzmq accepts one message byte, and gives every
connection fresh session keys: nothing to buffer for strangers, nothing to replay from
another connection, nothing readable on the wire.

Keys: the server's and decode's key pairs are derived from the MAC key (itself derived
from the secret), so operators still set one secret. The router's key pair is derived
from ``auth.router_mac``, one way from the MAC key, and the router is given only that and
the server's public key (``auth.RouterCredential``, printed by ``vllm-flagcx router
--print-credential``): nothing that holds it can derive decode's or the server's keys.
The server admits only the derived client keys (a ZAP handler on its own context) and
tags each message with the client's role: ``decode`` (may do everything) or ``router``
(may handshake and release, never pull or renew leases): least privilege for the
process that only frees what a vanished client left behind.

Where libzmq lacks CURVE (``zmq.has("curve")`` False: a vendor build without
libsodium), the channel falls back to the tag alone and says so once; a peer that
uses CURVE then refuses the connection, which ``handshake_failure`` explains.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from vllm_flagcx.wire import auth

logger = logging.getLogger("vllm_flagcx")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"vllm-flagcx"
ROLES = ("decode", "router")
ROUTER_MAY = ("HandshakeRequest", "Release")
_warned = False


def available() -> bool:
    """Does this libzmq do CURVE? Warned once when a secret is set and it does not."""
    global _warned
    import zmq

    if zmq.has("curve"):
        return True
    if not _warned:
        _warned = True
        logger.warning("FlagCX side channel: this libzmq has no CURVE (built without "
                       "libsodium); with a secret, messages are authenticated but travel "
                       "unencrypted")
    return False


def _keypair(key: bytes, label: str) -> tuple[bytes, bytes]:
    import zmq
    from zmq.utils import z85

    secret = z85.encode(hashlib.sha256(b"vllm-flagcx curve\0" + label.encode() + b"\0"
                                       + key).digest())
    return zmq.curve_public(secret), secret


def server_keypair(key: bytes) -> tuple[bytes, bytes]:
    return _keypair(key, "server")


def client_keypair(key: bytes, role: str) -> tuple[bytes, bytes]:
    """The key pair of ``role`` from the full MAC key (the router's via ``router_mac``)."""
    if role not in ROLES:
        raise ValueError(f"side-channel role {role!r}: use one of {', '.join(ROLES)}")
    return _keypair(auth.router_mac(key) if role == "router" else key, role)


def router_credential(key: bytes) -> auth.RouterCredential:
    """What the router is given: its MAC key and the server's public key, never ``key``."""
    return auth.RouterCredential(auth.router_mac(key), server_keypair(key)[0])


def load_router_credential(secret_file: str | None = None) -> auth.RouterCredential | None:
    """The router's credential from ``secret_file`` (or the secret variable): a printed
    credential as is; a full secret is reduced to the credential, with a warning that the
    file grants more than the router needs."""
    found = auth.read_secret(secret_file)
    if found is None:
        return None
    credential = auth.RouterCredential.parse(found[1])
    if credential is not None:
        return credential
    logger.warning("vllm-flagcx router: %s holds the full side-channel secret, which lets "
                   "its reader pull KV; give the router `vllm-flagcx router "
                   "--print-credential` instead", found[0])
    return router_credential(auth.key_of(*found))


def configure_client(sock: Any, key: bytes | auth.RouterCredential, role: str) -> None:
    if isinstance(key, auth.RouterCredential):
        public, secret = _keypair(key.mac, "router")
        sock.curve_serverkey = key.server_public
    else:
        public, secret = client_keypair(key, role)
        sock.curve_serverkey = server_keypair(key)[0]
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def configure_server(sock: Any, key: bytes) -> None:
    sock.curve_server = True
    sock.curve_secretkey = server_keypair(key)[1]
    sock.zap_domain = DOMAIN


class ZapHandler:
    """Admits the derived client keys on ``context`` and names their role (the messages'
    ``User-Id``). Its socket is served by the side-channel thread's poller (``handle``)."""

    def __init__(self, context: Any, key: bytes) -> None:
        import zmq
        from zmq.utils import z85

        self.roles = {z85.decode(client_keypair(key, role)[0]): role for role in ROLES}
        self.refused = 0
        self.sock = context.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    def handle(self) -> None:
        """Answer one ZAP request (RFC 27): 200 with the role, or 400."""
        frames = self.sock.recv_multipart()
        if len(frames) < 6:
            return  # not a ZAP request: REP must still answer something
        version, request_id, _domain, _address, _identity, mechanism, *credentials = frames
        role = (self.roles.get(credentials[0]) if mechanism == b"CURVE" and credentials
                else None)
        if role is None:
            self.refused += 1
        self.sock.send_multipart([version, request_id, b"200" if role else b"400",
                                  b"OK" if role else b"unknown client key",
                                  role.encode() if role else b"", b""])

    def close(self) -> None:
        self.sock.close()


def role_of(frame: Any) -> str:
    """The role a CURVE message's sender authenticated as ("" without CURVE)."""
    try:
        return str(frame.get("User-Id") or "")
    except Exception:  # no property: a NULL-mechanism connection
        return ""


def handshake_failure(event: int, value: int, with_key: bool) -> str | None:
    """Why a side-channel connection's handshake failed, from the client's monitor event
    (None for events that are not a handshake failure)."""
    import zmq

    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
            value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if with_key:
            return ("the peer's side channel has no secret (or its libzmq has no CURVE) "
                    f"but this instance has one; {auth.HOW_TO_SET}")
        return ("the peer's side channel requires the secret and this instance has none; "
                f"{auth.HOW_TO_SET}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the peer refused this instance's key: its secret differs; {auth.HOW_TO_SET}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and with_key:
        return ("the CURVE handshake with the peer failed: its secret differs from this "
                f"instance's; {auth.HOW_TO_SET}")
    return None
