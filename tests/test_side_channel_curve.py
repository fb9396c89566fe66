"""The side channel with a secret is CURVE (``wire.curve``): strangers are refused in the
connection's handshake, nothing readable crosses the wire, a captured frame replayed on
another connection is never delivered, and the router's credential may release but never
pull. Real prefill workers over loopback; a recording relay stands where a sniffer would."""

from __future__ import annotations

import os
import select
import selectors
import socket
import threading
import time

import pytest
import zmq
from testkit import pd_harness as pd

from vllm_flagcx.wire import auth, client, curve, endpoints
from vllm_flagcx.wire import handshake as hs

SECRET = "correct horse battery staple 42"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return str(path)


def _ask(port: int, message: hs.Message, key: bytes | None = None,
         role: str = "decode") -> hs.Message:
    return client.ask(zmq.Context.instance(), "127.0.0.1", port, message, 5.0, key=key,
                      role=role)


def test_without_the_secret_the_handshake_reveals_nothing(secret_file):
    """With a secret, a peer without it (or with another) does not get past the
    connection's CURVE handshake: no message of it reaches the server, the client is told
    which side lacks or differs in the secret, and no fact of the sheet travels."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", secret_file=secret_file)
    try:
        key = p.workers[0].settings.key
        assert isinstance(_ask(port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), key),
                          hs.HandshakeReply)
        with pytest.raises(auth.AuthError, match="requires the secret") as info:
            _ask(port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0))
        sheet = p.workers[0].sheet
        for fact in (sheet.engine_id, sheet.incarnation, str(sheet.regions[0].base)):
            assert fact not in str(info.value)
        wrong = auth.load_key(environ={auth.SECRET_ENV: "another secret of 32 chars!!"})
        with pytest.raises(auth.AuthError, match="differs"):
            _ask(port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), wrong)
        with pytest.raises(auth.AuthError):  # a Release without the key: not delivered
            _ask(port, hs.Release("anything"))
        # Knowing the server's public key is not enough: an underived client key is
        # refused by the ZAP handler, in the handshake.
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        stranger_public, stranger_secret = zmq.curve_keypair()
        sock.curve_serverkey = curve.server_keypair(key)[0]
        sock.curve_publickey, sock.curve_secretkey = stranger_public, stranger_secret
        sock.connect(endpoints.address("127.0.0.1", port))
        sock.send(b"anything")
        assert not sock.poll(1000)
        sock.close()
        assert p.workers[0].server.curve_refusals >= 1
        assert p.workers[0].stats["unauthenticated_messages"] == 0  # none got through
    finally:
        p.shutdown()


def test_the_routers_credential_may_release_but_never_pull(secret_file):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", secret_file=secret_file)
    try:
        key = p.workers[0].settings.key
        sheet = p.workers[0].sheet
        router = dict(key=key, role="router")
        assert isinstance(_ask(port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), **router),
                          hs.HandshakeReply)
        assert isinstance(_ask(port, hs.Release("t-1"), **router), hs.Ack)
        for message in (hs.PullRequest("t-1", sheet, ((1,),)), hs.Heartbeat(("t-1",))):
            answer = _ask(port, message, **router)
            assert isinstance(answer, hs.HandshakeRefused), answer
            assert "router credential" in answer.reason
        assert p.workers[0].stats["refused_roles"] == 2
    finally:
        p.shutdown()


def test_the_printed_router_credential_cannot_pull_pin_or_pose_as_decode(
        secret_file, capsys, monkeypatch):
    """The router is given ``--print-credential``'s output, not the secret: under it a
    pull and a heartbeat are refused, also when it claims the decode role (before: the
    router's file was the whole secret, from which decode's keys derive)."""
    from vllm_flagcx.router import cli

    assert cli.main(["--print-credential", "--side-channel-secret-file", secret_file]) == 0
    text = capsys.readouterr().out.strip()
    credential = auth.RouterCredential.parse(text)
    assert credential is not None and secret_file not in text
    key = auth.load_key(secret_file)
    assert credential.mac != key and key.hex() not in text
    assert curve.client_keypair(key, "decode")[1] not in text.encode()
    cred_file = os.path.join(os.path.dirname(secret_file), "router.cred")
    with open(cred_file, "w") as f:
        f.write(text)
    os.chmod(cred_file, 0o600)
    assert curve.load_router_credential(cred_file) == credential
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", secret_file=secret_file)
    try:
        sheet = p.workers[0].sheet
        assert isinstance(_ask(port, hs.Release("t-1"), key=credential, role="router"),
                          hs.Ack)
        for role in ("router", "decode"):
            for message in (hs.PullRequest("t-1", sheet, ((1,),)), hs.Heartbeat(("t-1",))):
                answer = _ask(port, message, key=credential, role=role)
                assert isinstance(answer, hs.HandshakeRefused), (role, answer)
                assert "router credential" in answer.reason
        assert p.workers[0].stats["lease_renewals"] == 0
    finally:
        p.shutdown()


def test_connections_that_never_finish_their_handshake_are_closed(secret_file):
    """2,000 idle TCP connections to a prefill with a secret (a stranger cannot complete
    CURVE): each is closed after ``HANDSHAKE_SECONDS``; an authenticated one still
    answers (before: every idle connection stayed open for good)."""
    import resource

    from vllm_flagcx.connector.prefill import gate as server

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2000 * 2 + 512  # both ends live in this process
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", secret_file=secret_file)
    idle = []
    try:
        for _ in range(2000):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        deadline = time.monotonic() + server.HANDSHAKE_SECONDS + 20
        watch = selectors.DefaultSelector()  # epoll: select() stops at fd 1024
        for sock in idle:
            watch.register(sock, selectors.EVENT_READ)
        still_open = len(idle)
        while still_open and time.monotonic() < deadline:
            for ready, _ in watch.select(0.5):
                if ready.fileobj.recv(4096) == b"":  # the server closed it
                    watch.unregister(ready.fileobj)
                    still_open -= 1
        watch.close()
        assert not still_open, f"{still_open} of 2000 idle connections still open"
        key = p.workers[0].settings.key
        assert isinstance(_ask(port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), key=key),
                          hs.HandshakeReply)
    finally:
        for sock in idle:
            sock.close()
        p.shutdown()


class _Tap:
    """A loopback relay that records every byte between a client and the side channel
    (what a sniffer on the path would see). Test-only; bounded by its timeout."""

    def __init__(self, target_port: int, timeout: float = 5.0) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.seen = bytearray()
        self._thread = threading.Thread(target=self._pump, args=(target_port, timeout),
                                        daemon=True)
        self._thread.start()

    def _pump(self, target_port: int, timeout: float) -> None:
        self.server.settimeout(timeout)
        try:
            client_side, _ = self.server.accept()
        except OSError:
            return
        path = endpoints.local_socket("127.0.0.1", target_port)
        if path is not None:  # the relay stands where TCP would be: bytes go to the socket
            upstream = socket.socket(socket.AF_UNIX)
            upstream.settimeout(timeout)
            upstream.connect(path)
        else:
            upstream = socket.create_connection(("127.0.0.1", target_port), timeout=timeout)
        ends = {client_side: upstream, upstream: client_side}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select(list(ends), [], [], 0.05)
            for sock in ready:
                data = sock.recv(65536)
                if not data:
                    deadline = 0
                    break
                self.seen += data
                ends[sock].sendall(data)
        for sock in ends:
            sock.close()

    def close(self) -> None:
        self.server.close()
        self._thread.join(timeout=6)


@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret-control"])
def test_with_a_secret_the_sheet_never_crosses_the_wire_in_clear(secret_file, with_secret):
    """A handshake through a recording relay: with a secret the sheet's facts appear
    nowhere in the bytes (CURVE); the control without one shows the relay does see
    them in clear, so the check can fail."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense",
                          secret_file=secret_file if with_secret else None)
    tap = _Tap(port)
    try:
        key = p.workers[0].settings.key
        answer = client.ask(zmq.Context.instance(), "127.0.0.1", tap.port,
                            hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), 5.0, key=key)
        assert isinstance(answer, hs.HandshakeReply)
        tap.close()
        sheet = p.workers[0].sheet
        clear = sheet.engine_id.encode() in tap.seen or sheet.incarnation.encode() in tap.seen
        assert clear != with_secret
    finally:
        tap.close()
        p.shutdown()


def test_a_captured_sealed_frame_replayed_without_the_session_is_not_delivered(
        secret_file):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", secret_file=secret_file)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        key = p.workers[0].settings.key
        sock.connect(endpoints.address("127.0.0.1", port))
        sock.send(auth.seal(key, hs.encode(hs.Heartbeat(("t-1",)))))
        assert not sock.poll(1000)  # never delivered, never answered
        assert p.workers[0].stats["lease_renewals"] == 0
        assert p.workers[0].stats["unauthenticated_messages"] == 0
    finally:
        sock.close()
        p.shutdown()
