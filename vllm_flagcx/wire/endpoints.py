"""Where a side channel listens and how a peer reaches it: a Unix socket on the same host,
TCP across hosts.

Why a Unix socket: the kernel records who connected (``SO_PEERCRED``: pid, uid, gid, taken
at connect), and libzmq hands that record to every message of the connection. Over TCP
the side channel could only look the peer up afterwards (by fd number, which a later
connection may reuse) and not at all for a peer reaching this host through a routable
address, so a same-host pull could steer prefill's ``process_vm_writev`` into a process
of the caller's choosing. The socket lives in a directory only this user may open
(mode 0700, owned by the engine's uid, checked before use), so without a secret another
user cannot even connect; nothing of theirs is buffered.

The directory: ``FLAGCX_SIDE_CHANNEL_SOCKET_DIR`` if set (the same on prefill, decode
and the router; a container must mount it to be reached this way), else
``<tmp>/vllm-flagcx-<uid>``. The socket of side-channel port ``p`` is ``side-<p>.sock``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import stat
import tempfile
from collections.abc import Mapping

SOCKET_DIR_ENV = "FLAGCX_SIDE_CHANNEL_SOCKET_DIR"
MAX_PATH_BYTES = 107  # sun_path holds 108 bytes, the last one NUL


class SocketDirError(OSError):
    """The socket directory is unusable; the message names the variable and the fix."""


def socket_dir(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(SOCKET_DIR_ENV) or os.path.join(tempfile.gettempdir(),
                                                       f"vllm-flagcx-{os.getuid()}")


def socket_path(port: int, directory: str | None = None) -> str:
    path = os.path.join(directory or socket_dir(), f"side-{port}.sock")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise SocketDirError(f"{SOCKET_DIR_ENV}: the socket path {path!r} is longer than "
                             f"{MAX_PATH_BYTES} bytes; name a shorter directory")
    return path


def _private(info: os.stat_result) -> bool:
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & 0o077)


def ensure_private_dir(directory: str | None = None) -> str:
    """Create the socket directory (0700) or check an existing one is this user's alone;
    SocketDirError naming the variable otherwise."""
    directory = directory or socket_dir()
    with contextlib.suppress(FileExistsError):
        os.makedirs(directory, mode=0o700)
    try:
        info = os.lstat(directory)
    except OSError as exc:
        raise SocketDirError(f"{SOCKET_DIR_ENV}={directory!r}: {exc.strerror}") from None
    if not _private(info):
        raise SocketDirError(
            f"{SOCKET_DIR_ENV}={directory!r}: the side channel's socket directory must be "
            f"a directory owned by uid {os.getuid()} with mode 700 (it is uid "
            f"{info.st_uid}, mode {info.st_mode & 0o777:o}); `chmod 700` it, or point "
            f"{SOCKET_DIR_ENV} at a directory only this user can open")
    return directory


@functools.lru_cache(maxsize=256)
def is_this_host(host: str) -> bool:
    """Is ``host`` an address of this machine (loopback or one of its interfaces)?"""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_DGRAM,
                                   flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def local_socket(host: str, port: int, directory: str | None = None) -> str | None:
    """The Unix socket of this host's side channel on ``port``, where ``host`` is this
    machine, this user's private directory holds it and a process listens there (a file
    left by a killed engine is not followed: ZMQ would retry it silently); else None
    (use TCP)."""
    if not is_this_host(host):
        return None
    try:
        path = socket_path(port, directory)
        if not _private(os.lstat(os.path.dirname(path))):
            return None
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    return path if in_use(path) else None


def address(host: str, port: int, directory: str | None = None) -> str:
    """The ZMQ address a client connects to for the side channel at ``host:port``."""
    path = local_socket(host, port, directory)
    if path is not None:
        return f"ipc://{path}"
    return f"tcp://{host}:{port}"


def hint(host: str, port: int) -> str:
    """What to add to a failed exchange with a peer on this host reached over TCP: without
    a secret prefill listens only on its Unix socket, which this process may not see."""
    if not is_this_host(host) or local_socket(host, port) is not None:
        return ""
    return (f"; no side-channel socket for port {port} in {socket_dir()}: without a secret "
            f"prefill listens only there, so give decode and the router the same "
            f"{SOCKET_DIR_ENV} as prefill (and mount it into containers), or set a secret "
            "on every instance")


def listening(host: str, port: int, timeout: float = 0.5) -> bool | None:
    """True: something accepts connections at the side channel of ``host:port``; False:
    refused (nothing listens there); None: no verdict within ``timeout``."""
    if local_socket(host, port) is not None:  # it found a live listener already
        return True
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def in_use(path: str) -> bool:
    """Does a live process accept connections on the Unix socket ``path``?"""
    try:
        with socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(0.5)
            probe.connect(path)
        return True
    except OSError:
        return False
