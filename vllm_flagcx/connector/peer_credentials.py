"""Who is on the other end of a loopback side-channel connection, as the kernel says.

Why: loopback TCP checks no user. Without a secret, any local user could pull (making
prefill ``process_vm_writev`` into a process of its choosing, as prefill's user), release
or read the sheet; with one, any holder of the secret could name another process's pid in
its transport description. The kernel knows both answers: ``sock_diag`` (netlink) or
``/proc/net/tcp{,6}`` give each socket's owner uid and inode, and ``/proc/<pid>/fd``
which process holds an inode.

* ``connection_of(fd)``: the (peer, local) addresses of the TCP connection a ZMQ message
  came in on (``zmq.SRCFD``);
* ``loopback_owner``: the uid and inode of the PEER's socket of a loopback connection;
* ``holds_socket``: does process ``pid`` hold that socket (is it the one talking)?

Linux only; elsewhere (no ``/proc``) every answer is None and the callers refuse what
they cannot verify.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from typing import NamedTuple

from vllm_flagcx.connector import sock_diag

logger = logging.getLogger("vllm_flagcx")

PROC = "/proc"
# A process found holding a socket keeps that verdict this long. Why: ``holds_socket``
# reads every open file of the process (measured: 1.0 ms at 200 fds, 7.8 ms at 2,000; a
# serving vLLM engine holds hundreds), and a kept side-channel connection sends every pull
# of its decode worker over the same socket. Only a verdict that it holds it is kept.
HELD_SECONDS = 10.0
HELD_MAX = 1024  # kept verdicts at most (expired ones are dropped first)


class Owner(NamedTuple):
    uid: int
    inode: int


def connection_of(fd: int) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """(peer address, local address) of the TCP socket ``fd``; None if it is not one."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        peer, local = sock.getpeername(), sock.getsockname()
    except OSError:
        return None
    finally:
        sock.close()
    if not (isinstance(peer, tuple) and isinstance(local, tuple)):
        return None
    return (str(peer[0]), int(peer[1])), (str(local[0]), int(local[1]))


def is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _hex_address(address: str, port: int) -> tuple[str, str]:
    """(file, "ADDR:PORT") as ``/proc/net/tcp`` or ``tcp6`` writes it: each 32-bit word
    of the address in host (little-endian) byte order, upper-case hex."""
    ip = ipaddress.ip_address(address)
    raw = ip.packed
    words = "".join(raw[i:i + 4][::-1].hex() for i in range(0, len(raw), 4)).upper()
    return ("tcp" if ip.version == 4 else "tcp6"), f"{words}:{port:04X}"


def loopback_owner(peer: tuple[str, int], local: tuple[str, int], proc: str = PROC
                   ) -> Owner | None:
    """The uid and inode of the peer's end of a loopback TCP connection (the socket whose
    local address is ``peer`` and remote address ``local``); None when not found.

    The kernel is asked by netlink first (microseconds); ``/proc/net/tcp{,6}`` is read
    (milliseconds) only where that fails, or when ``proc`` names another tree."""
    if proc == PROC:
        found = sock_diag.tcp_socket_owner(peer, local)
        if found is not None:
            return Owner(found.uid, found.inode)
    table, peer_hex = _hex_address(*peer)
    _, local_hex = _hex_address(*local)
    try:
        with open(f"{proc}/net/{table}", "rb") as f:
            data = f.read()
    except OSError:
        return None
    needle = f" {peer_hex} {local_hex} ".encode()
    at = data.find(needle)
    if at < 0:
        return None
    line = data[at:data.find(b"\n", at)].split()
    # local rem st tx:rx tr:when retrnsmt uid timeout inode ...
    try:
        return Owner(int(line[6]), int(line[8]))
    except (IndexError, ValueError):
        return None


def holds_socket(pid: int, inode: int, proc: str = PROC) -> bool:
    """Does process ``pid`` hold socket ``inode`` among its open files?"""
    target = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{proc}/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


class PeerCheck:
    """The side channel's kernel-backed check of who sends a message.

    ``authenticated``: the channel has a secret (messages are MAC-tagged): peers of any
    user and host may talk, but a same-host pull must come from the process its transport
    names. Without one (loopback only): only this uid may talk at all."""

    def __init__(self, authenticated: bool, proc: str = PROC) -> None:
        self.authenticated = authenticated
        self.proc = proc
        self.uid = os.getuid()
        self._no_proc_warned = False
        self._held: dict[tuple[int, int], float] = {}  # (pid, inode) -> kept until

    def _holds(self, pid: int, inode: int) -> bool:
        """``holds_socket``, with a yes kept for ``HELD_SECONDS`` (a no is never kept)."""
        now = time.monotonic()
        if self._held.get((pid, inode), 0.0) > now:
            return True
        if not holds_socket(pid, inode, self.proc):
            return False
        if len(self._held) >= HELD_MAX:
            self._held = {k: t for k, t in self._held.items() if t > now}
            if len(self._held) >= HELD_MAX:
                self._held.clear()
        self._held[(pid, inode)] = now + HELD_SECONDS
        return True

    def refusal(self, fd: int | None, declared_pid: int | None = None) -> str | None:
        """Why the message that came in on ``fd`` must be refused, or None."""
        refused, owner = self.inspect(fd)
        if refused is not None or declared_pid is None:
            return refused
        return self.pid_refusal(owner, declared_pid)

    def inspect(self, fd: int | None) -> tuple[str | None, Owner | None]:
        """(why the message that came in on ``fd`` must be refused, or None; the owner of
        the peer's socket where it is a local peer the kernel lists, for ``pid_refusal``
        of the same message without asking the kernel again)."""
        conn = connection_of(fd) if fd is not None and fd >= 0 else None
        if conn is None:
            return (None if self.authenticated else (
                "the side channel cannot tell who is connecting (not a TCP connection)"), None)
        peer, local = conn
        if not is_loopback(peer[0]):
            return (None if self.authenticated else (
                f"a peer at {peer[0]} on a side channel without a secret"), None)
        owner = loopback_owner(peer, local, self.proc)
        if owner is None:
            if not os.path.exists(f"{self.proc}/net/tcp"):
                if not self._no_proc_warned:
                    self._no_proc_warned = True
                    logger.warning("FlagCX side channel: no %s/net/tcp here, so local "
                                   "peers' users and processes cannot be checked", self.proc)
                return None, None
            return f"the kernel lists no socket for the peer at {peer[0]}:{peer[1]}", None
        if not self.authenticated and owner.uid != self.uid:
            return (f"the connecting process runs as uid {owner.uid}: without a secret this "
                    f"side channel serves only uid {self.uid} on this host (set the same "
                    "secret on prefill, decode and the router to serve other users)"), owner
        return None, owner

    def pid_refusal(self, owner: Owner | None, declared_pid: int) -> str | None:
        """Why a pull from the peer ``inspect`` found (``owner``; None: not a local peer
        the kernel lists, nothing to check) may not name ``declared_pid``, or None."""
        if owner is not None and not self._holds(declared_pid, owner.inode):
            return (f"the pull's transport names pid {declared_pid}, but the connection "
                    "comes from another process: a pull may only name its own process")
        return None
