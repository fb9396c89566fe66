"""Same-host peers of the side channel, as the kernel recorded them at connect.

A same-host pull makes prefill write into the process the pull names; only the process
that opened the Unix-socket connection, running as it did then, may be named. Before
(loopback TCP, peers looked up by fd number afterwards): a pull over the host's routable
address skipped the pid check and prefill wrote into a root bystander; an fd handed to a
child and a 10 s verdict cache let a set-user-ID program be named; a closed connection's
messages were attributed to the next connection holding the same fd number; and without
a secret another uid could connect and make prefill buffer 3.5 GB. Tested on the real
kernel (Unix sockets, ``/proc``), with another uid where this test runs as root.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import msgspec
import pytest
import zmq
from testkit import pd_harness as pd

from vllm_flagcx.connector.common.counters import Counters
from vllm_flagcx.connector.prefill import gate as pc
from vllm_flagcx.connector.prefill.gate import Admitted, Gate
from vllm_flagcx.wire import client, endpoints
from vllm_flagcx.wire import handshake as hs

NOBODY = 65534


def _as_nobody(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a child that drops to uid/gid 65534 after its imports."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ,
                                           "PYTHONPATH": os.pathsep.join(sys.path)})


def _this_process() -> pc.PeerCred:
    return pc.PeerCred(os.getuid(), os.getgid(), os.getpid())


def test_libzmq_hands_every_message_the_kernels_record_of_its_connection():
    with tempfile.TemporaryDirectory(prefix="fx-") as directory:
        context = zmq.Context()
        server, sender = context.socket(zmq.ROUTER), context.socket(zmq.REQ)
        try:
            server.bind(f"ipc://{directory}/s")
            sender.connect(f"ipc://{directory}/s")
            sender.send(b"x")
            assert server.poll(5000)
            parts = server.recv_multipart(copy=False)
            assert pc.from_peer_address(parts[-1].get("Peer-Address")) == _this_process()
        finally:
            sender.close(0)
            server.close(0)
            context.term()


def test_peer_addresses_without_a_full_record_are_not_credentials():
    assert pc.from_peer_address("localhost:1000:100:4242") == pc.PeerCred(1000, 100, 4242)
    for value in (None, "", "127.0.0.1", "::1", "localhost:1:2", "x:a:b:c", "h:0:0:0",
                  "h:-1:0:5"):
        assert pc.from_peer_address(value) is None, value


def test_a_process_is_named_only_by_itself_as_it_ran_when_it_connected(tmp_path):
    me = _this_process()
    assert pc.target_refusal(me, me.pid) is None
    assert "came over TCP" in pc.target_refusal(None, me.pid)
    assert f"opened by pid {me.pid}" in pc.target_refusal(me, me.pid + 1)
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "status").write_text(
        f"Name:\tx\nUid:\t{me.uid}\t0\t0\t0\nGid:\t{me.gid}\t{me.gid}\t{me.gid}\t{me.gid}\n")
    setuid_exec = pc.PeerCred(me.uid, me.gid, 77)
    if me.uid != 0:  # a set-user-ID root program: effective, saved and fs uid 0
        assert "now runs as uids" in pc.target_refusal(setuid_exec, 77, str(tmp_path))
    assert pc.target_refusal(pc.PeerCred(me.uid + 1, me.gid, 77), 77,
                             str(tmp_path)).startswith("process 77 now runs as")
    assert pc.target_refusal(pc.PeerCred(me.uid, me.gid, 78), 78,
                             str(tmp_path)) == "process 78 is gone"


def test_each_message_keeps_the_identity_of_the_connection_it_came_on(tmp_path):
    """900 messages from a child that then exits, then one from this process, through
    the real gate: every one is attributed to the process that opened its connection
    (before: identity was looked up by fd number, which the next connection may hold)."""
    with tempfile.TemporaryDirectory(prefix="fx-") as directory:
        context = zmq.Context()
        server = context.socket(zmq.ROUTER)
        server.bind(f"ipc://{directory}/s")
        code = textwrap.dedent(f"""
            import os, zmq
            c = zmq.Context(); s = c.socket(zmq.DEALER)
            s.connect("ipc://{directory}/s")
            for _ in range(900):
                s.send_multipart([b"", b"release"])
            s.close(linger=5000); c.term(); print(os.getpid())
        """)
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=60, check=True)
        mine = context.socket(zmq.REQ)
        mine.connect(f"ipc://{directory}/s")
        mine.send(b"mine")
        gate, seen = Gate(None, Counters()), []
        try:
            while len(seen) < 901 and server.poll(5000):
                verdict = gate.admit(server.recv_multipart(copy=False), False, local=True)
                assert isinstance(verdict, Admitted)
                seen.append((verdict.data, verdict.peer.pid))
        finally:
            mine.close(0)
            server.close(0)
            context.term()
    child_pid = int(child.stdout)
    assert seen.count((b"release", child_pid)) == 900
    assert seen.count((b"mine", os.getpid())) == 1


def _pull(p):
    sheet = p.workers[0].sheet
    blocks = ((1,),) * len(sheet.layout.block_sizes)
    return hs.PullRequest("t-1", msgspec.structs.replace(sheet, incarnation="x"), blocks)


def test_a_pull_naming_another_process_is_refused():
    """The same-host transport writes into the pid the pull's sheet names: only the
    process that connected (a child handed its fd names itself, and is refused too)."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    try:
        other = 1 if os.getpid() != 1 else 2
        p.workers[0].transport.peer_pid = lambda desc: other
        answer = client.ask(zmq.Context.instance(), "127.0.0.1", port, _pull(p), 5.0)
        assert isinstance(answer, hs.PullReply) and not answer.ok
        assert f"names pid {other}" in answer.error
        p.workers[0].transport.peer_pid = lambda desc: os.getpid()
        with pytest.raises(TimeoutError):  # its own pid: accepted, parked for "t-1"
            client.ask(zmq.Context.instance(), "127.0.0.1", port, _pull(p), 0.5)
        assert p.workers[0].stats["refused_peers"] == 1
    finally:
        p.shutdown()


def test_a_same_host_pull_over_tcp_is_refused_whatever_its_address(tmp_path):
    """With a secret the side channel also listens on TCP (other hosts); a pull for the
    same-host transport arriving there is refused even naming its own pid (before: a
    peer on a non-loopback address skipped the check and prefill wrote where it said)."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", secret_file=str(secret))
    key = p.workers[0].settings.key
    try:
        p.workers[0].transport.peer_pid = lambda desc: os.getpid()
        path = endpoints.socket_path(port)
        hidden = f"{path}.hidden"  # this client cannot see the socket: it must use TCP
        os.rename(path, hidden)
        try:
            assert endpoints.address("127.0.0.1", port).startswith("tcp://")
            answer = client.ask(zmq.Context(), "127.0.0.1", port, _pull(p), 5.0, key=key)
        finally:
            os.rename(hidden, path)
        assert isinstance(answer, hs.PullReply) and not answer.ok
        assert "came over TCP" in answer.error
        with pytest.raises(TimeoutError):  # over the Unix socket: accepted, parked
            client.ask(zmq.Context(), "127.0.0.1", port, _pull(p), 0.5, key=key)
    finally:
        p.shutdown()


def _root_only() -> None:
    if os.getuid() != 0:
        pytest.skip("switching to another uid needs root; the checks are tested above")


def test_another_uid_cannot_even_connect_without_a_secret():
    """No TCP port, and the socket's directory is 0700: nothing of theirs is buffered."""
    _root_only()
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    path = endpoints.socket_path(port)
    code = textwrap.dedent(f"""
        import os, socket
        os.setgid({NOBODY}); os.setuid({NOBODY})
        for family, where in ((socket.AF_UNIX, {path!r}), (socket.AF_INET,
                                                            ("127.0.0.1", {port}))):
            s = socket.socket(family)
            try:
                s.connect(where); print("connected")
            except OSError as exc:
                print(type(exc).__name__)
    """)
    try:
        out = _as_nobody(code)
        assert out.stdout.split() == ["PermissionError", "ConnectionRefusedError"], out
        assert isinstance(client.ask(zmq.Context.instance(), "127.0.0.1", port,
                                     hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), 5.0),
                          hs.HandshakeReply)  # this uid still is served
    finally:
        p.shutdown()


def test_a_process_whose_credentials_changed_after_connecting_is_not_written_into():
    """A child connects as root, then becomes uid 65534 (as an exec of a set-user-ID
    program changes them the other way) and pulls naming itself: refused by the kernel's
    record against ``/proc``, at admission and again at write time."""
    _root_only()
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    pull = hs.encode(_pull(p))
    code = textwrap.dedent(f"""
        import os, zmq
        from vllm_flagcx.wire import endpoints, handshake as hs
        c = zmq.Context(); s = c.socket(zmq.REQ)
        s.connect(endpoints.address("127.0.0.1", {port}))
        s.send(hs.encode(hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0))); s.recv()
        os.setgid({NOBODY}); os.setuid({NOBODY})
        print(os.getpid(), flush=True)
        input()
        s.send({pull!r})
        print(hs.decode(s.recv()).error, flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child_pid = int(child.stdout.readline())
        p.workers[0].transport.peer_pid = lambda desc: child_pid
        out, err = child.communicate("\n", timeout=30)
        assert f"process {child_pid} now runs as uids" in out, (out, err[-2000:])
    finally:
        child.kill()
        p.shutdown()


def test_the_socket_directory_must_be_this_users_alone(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(endpoints.SocketDirError, match="FLAGCX_SIDE_CHANNEL_SOCKET_DIR"):
        endpoints.ensure_private_dir(str(loose))
    made = endpoints.ensure_private_dir(str(tmp_path / "new"))
    assert os.stat(made).st_mode & 0o777 == 0o700
    with pytest.raises(endpoints.SocketDirError, match="longer than 107"):
        endpoints.socket_path(1, "/" + "d" * 120)
    assert endpoints.local_socket("127.0.0.1", 1, str(loose)) is None
    assert endpoints.is_this_host("127.0.0.1")
    assert not endpoints.is_this_host("192.0.2.1") and not endpoints.is_this_host("x y")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(made, "side-7.sock"))
    try:  # a file nobody listens on (a killed engine's) is not followed
        assert endpoints.address("127.0.0.1", 7, made) == "tcp://127.0.0.1:7"
        sock.listen()
        assert endpoints.address("127.0.0.1", 7, made) == f"ipc://{made}/side-7.sock"
        assert endpoints.address("192.0.2.1", 7, made) == "tcp://192.0.2.1:7"
    finally:
        sock.close()
    assert endpoints.SOCKET_DIR_ENV in endpoints.hint("127.0.0.1", 1)  # no socket here: said
    assert endpoints.hint("192.0.2.1", 1) == ""  # another host: TCP is the way


def test_a_decode_that_cannot_see_prefills_socket_is_told_which_directory(monkeypatch):
    """Prefill without a secret listens only on its Unix socket; a decode with another
    directory (a container without the mount) reaches nothing: the error says why."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    try:
        monkeypatch.setenv(endpoints.SOCKET_DIR_ENV, tempfile.mkdtemp(prefix="fx-"))
        with pytest.raises(client.PeerGoneError, match=endpoints.SOCKET_DIR_ENV):
            client.ask(zmq.Context(), "127.0.0.1", port,
                       hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), 5.0, probe_every=0.2)
    finally:
        p.shutdown()
