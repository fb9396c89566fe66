"""Who is on the other end of a same-host side-channel connection, as the kernel says.

A same-host pull makes prefill write (``process_vm_writev``, CUDA IPC) into the process
its sheet names, so that process must be the one that connected, as it is now. The
kernel records the connecting process of a Unix socket at ``connect`` (``SO_PEERCRED``:
pid, uid, gid), and libzmq attaches that record to every message of the connection (its
``Peer-Address`` property, ``...:uid:gid:pid``): the identity belongs to the connection
for its whole life, not to an fd number looked up after the fact (libzmq delivers a
closed connection's messages while a new connection may hold the same fd number).

Checked per pull, at admission and again right before the write (``target_refusal``):

* it came over the Unix socket (a TCP peer has no kernel record: refused, whatever its
  address says, since a same-host process may reach this host's routable address);
* the pid it names is the pid that connected (an fd handed to a child does not let the
  child name itself, or anyone else);
* that process still runs as the uid and gid it connected as, real, effective, saved
  and filesystem ids alike (``/proc/<pid>/status``): an exec of a set-user-ID program
  after connecting, or a pid recycled by another user's process, is refused.

What it does not catch: a pid recycled by a process of the same user and group (which
could be written into anyway by that user), or an exec that gains file capabilities.
"""

from __future__ import annotations

from typing import NamedTuple

PROC = "/proc"


class PeerCred(NamedTuple):
    """The connecting process of a Unix-socket connection, as the kernel recorded it."""

    uid: int
    gid: int
    pid: int


def from_peer_address(value: str | None) -> PeerCred | None:
    """The credentials in libzmq's ``Peer-Address`` of an ``ipc://`` connection
    (``<host>:<uid>:<gid>:<pid>``); None when it holds none. Read only for messages of
    the Unix-socket endpoint: a TCP peer's address is never parsed as one."""
    if not value:
        return None
    parts = value.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(p) for p in parts[1:])
    except ValueError:
        return None
    return PeerCred(uid, gid, pid) if pid > 0 and uid >= 0 and gid >= 0 else None


def process_ids(pid: int, proc: str = PROC) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(uids, gids) of process ``pid``: real, effective, saved, filesystem; None when no
    such process is visible."""
    try:
        with open(f"{proc}/{pid}/status", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    found: dict[str, tuple[int, ...]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Uid", "Gid"):
            try:
                found[name] = tuple(int(v) for v in rest.split())
            except ValueError:
                return None
    if len(found.get("Uid", ())) != 4 or len(found.get("Gid", ())) != 4:
        return None
    return found["Uid"], found["Gid"]


def target_refusal(peer: PeerCred | None, declared_pid: int, proc: str = PROC) -> str | None:
    """Why a same-host pull from ``peer`` (None: not a Unix-socket connection) may not
    make prefill write into process ``declared_pid``, or None (see the module docstring)."""
    if peer is None:
        return ("a same-host transport's pull must come over the side channel's Unix "
                "socket (the kernel vouches for its process); this one came over TCP. Run "
                "decode with the same FLAGCX_SIDE_CHANNEL_SOCKET_DIR as prefill, or set "
                "kv_connector_extra_config.transport='flagcx'")
    if declared_pid != peer.pid:
        return (f"the pull's transport names pid {declared_pid}, but the connection was "
                f"opened by pid {peer.pid}: a pull may only name its own process")
    ids = process_ids(declared_pid, proc)
    if ids is None:
        return f"process {declared_pid} is gone"
    uids, gids = ids
    if set(uids) != {peer.uid} or set(gids) != {peer.gid}:
        return (f"process {declared_pid} now runs as uids {uids} / gids {gids}, not as "
                f"uid {peer.uid} / gid {peer.gid} it connected as (an exec of a "
                "set-user-ID program?): not written into")
    return None
