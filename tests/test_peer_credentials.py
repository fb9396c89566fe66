"""Local peers of the side channel, as the kernel vouches for them.

Without a secret, only this uid may talk to prefill's side channel (before: any local
user could pull, release, heartbeat and read the sheet over loopback TCP); with or without
one, a same-host pull may only name its own process as the write's target (before: any
pid the caller liked, so a root prefill wrote into a bystander). Tested against the real
kernel tables (``/proc/net/tcp``, ``/proc/<pid>/fd``), with another uid where this test
runs as root, and on crafted tables for the parsing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import msgspec
import pytest
import zmq
from testkit import pd_harness as pd

from vllm_flagcx.connector import peer_credentials as pc
from vllm_flagcx.wire import client
from vllm_flagcx.wire import handshake as hs


def _loopback_pair():
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    return server, peer, conn


def test_the_kernel_names_this_process_as_the_owner_of_a_loopback_peer():
    server, peer, conn = _loopback_pair()
    try:
        found = pc.connection_of(conn.fileno())
        assert found is not None
        remote, local = found
        assert remote == peer.getsockname() and local == server.getsockname()
        owner = pc.loopback_owner(remote, local)
        assert owner is not None and owner.uid == os.getuid()
        assert pc.holds_socket(os.getpid(), owner.inode)
        assert not pc.holds_socket(1 if os.getpid() != 1 else 2, owner.inode)
    finally:
        for s in (peer, conn, server):
            s.close()


def test_the_tables_are_read_as_the_kernel_writes_them(tmp_path):
    (tmp_path / "net").mkdir()
    line = ("   0: 0100007F:D9B0 0100007F:15E0 01 00000000:00000000 00:00000000 00000000  "
            "1234        0 987654 1 0000000000000000 20 4 30 10 -1\n")
    (tmp_path / "net" / "tcp").write_text("  sl  local_address rem_address ...\n" + line)
    owner = pc.loopback_owner(("127.0.0.1", 0xD9B0), ("127.0.0.1", 0x15E0), str(tmp_path))
    assert owner == pc.Owner(1234, 987654)
    assert pc.loopback_owner(("127.0.0.1", 1), ("127.0.0.1", 0x15E0), str(tmp_path)) is None
    (tmp_path / "77" / "fd").mkdir(parents=True)
    os.symlink("socket:[987654]", tmp_path / "77" / "fd" / "5")
    assert pc.holds_socket(77, 987654, str(tmp_path))
    assert not pc.holds_socket(77, 987655, str(tmp_path))
    assert not pc.holds_socket(78, 987654, str(tmp_path))


def test_ipv6_and_mapped_loopback_addresses():
    assert pc.is_loopback("::1") and pc.is_loopback("::ffff:127.0.0.1")
    assert not pc.is_loopback("10.0.0.1") and not pc.is_loopback("nonsense")
    assert pc._hex_address("::1", 80) == ("tcp6", "00000000000000000000000001000000:0050")


def test_a_pull_naming_another_process_is_refused():
    """The same-host transport writes into the pid the pull's sheet names: it must be the
    process on the other end of the connection (the kernel says which holds it)."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    try:
        sheet = p.workers[0].sheet
        blocks = ((1,),) * len(sheet.layout.block_sizes)
        pull = hs.PullRequest("t-1", msgspec.structs.replace(sheet, incarnation="x"), blocks)
        other = 1 if os.getpid() != 1 else 2
        p.workers[0].transport.peer_pid = lambda desc: other
        answer = client.ask(zmq.Context.instance(), "127.0.0.1", port, pull, 5.0)
        assert isinstance(answer, hs.PullReply) and not answer.ok
        assert f"names pid {other}" in answer.error
        p.workers[0].transport.peer_pid = lambda desc: os.getpid()
        with pytest.raises(TimeoutError):  # its own pid: accepted, parked for "t-1"
            client.ask(zmq.Context.instance(), "127.0.0.1", port, pull, 0.5)
        assert p.workers[0].stats["refused_peers"] == 1
    finally:
        p.shutdown()


def test_another_uid_gets_nothing_without_a_secret():
    if os.getuid() != 0:
        pytest.skip("switching to another uid needs root; the check itself is tested above")
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    code = textwrap.dedent(f"""
        import os, socket, zmq
        from vllm_flagcx.wire import client, handshake as hs
        os.setgid(65534); os.setuid(65534)  # after the imports: nobody cannot read them
        for message in (hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), hs.Release("t"),
                        hs.Heartbeat(("t",))):
            answer = client.ask(zmq.Context.instance(), "127.0.0.1", {port}, message, 5.0)
            print(type(answer).__name__, getattr(answer, "reason", ""))
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 sys.path)})
        lines = out.stdout.strip().splitlines()
        assert len(lines) == 3, out.stderr[-2000:]
        assert all(line.startswith("HandshakeRefused") and "uid 65534" in line
                   for line in lines), lines
        assert p.workers[0].stats["refused_peers"] == 3
        assert isinstance(client.ask(zmq.Context.instance(), "127.0.0.1", port,
                                     hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), 5.0),
                          hs.HandshakeReply)  # this uid still is served
    finally:
        p.shutdown()


def test_netlink_and_the_proc_table_name_the_same_owner():
    """The fast path (sock_diag) must agree with the table it replaces, and a request is
    read back as the kernel's header says (``linux/inet_diag.h``)."""
    from vllm_flagcx.connector import sock_diag

    server, peer, conn = _loopback_pair()
    try:
        remote, local = pc.connection_of(conn.fileno())
        fast = sock_diag.tcp_socket_owner(remote, local)
        if fast is None:
            pytest.skip("NETLINK_SOCK_DIAG is not available here")
        slow = pc.loopback_owner(remote, local, proc=pc.PROC + "/self/..")
        assert slow is not None and (fast.uid, fast.inode) == (slow.uid, slow.inode)
        assert fast.inode == os.fstat(peer.fileno()).st_ino
        assert sock_diag.tcp_socket_owner(remote, ("127.0.0.1", 1)) is None
    finally:
        for s in (peer, conn, server):
            s.close()
    message = sock_diag.request_bytes(("127.0.0.1", 0x1234), ("127.0.0.1", 0x5678))
    assert len(message) == 16 + 8 + 48
    assert message[16] == socket.AF_INET and message[17] == socket.IPPROTO_TCP
    assert message[24:28] == bytes.fromhex("12345678")
    assert sock_diag.parse_reply(b"\x00" * 8) is None
    with pytest.raises(ValueError):
        sock_diag.request_bytes(("127.0.0.1", 1), ("::1", 2))


def test_a_process_found_holding_the_socket_is_not_searched_again_for_a_while(
        tmp_path, monkeypatch):
    """The fd scan runs once per (pid, socket) for ``HELD_SECONDS``; a refusal is never
    kept (a pid that did not hold the socket is searched again), and the verdict ends."""
    (tmp_path / "77" / "fd").mkdir(parents=True)
    link = tmp_path / "77" / "fd" / "5"
    check = pc.PeerCheck(authenticated=True, proc=str(tmp_path))
    scans = []
    real = pc.holds_socket
    monkeypatch.setattr(pc, "holds_socket",
                        lambda pid, inode, proc: scans.append(pid) or real(pid, inode, proc))
    assert not check._holds(77, 987654)  # not held yet: refused, and not remembered
    os.symlink("socket:[987654]", link)
    assert check._holds(77, 987654)
    assert len(scans) == 2
    link.unlink()  # within the time the verdict is kept, no scan
    assert check._holds(77, 987654) and len(scans) == 2
    assert not check._holds(77, 987655)  # another socket is searched
    now = pc.time.monotonic()
    monkeypatch.setattr(pc.time, "monotonic", lambda: now + pc.HELD_SECONDS + 1)
    assert not check._holds(77, 987654)  # the verdict ended: searched, and gone
    assert len(scans) == 4
