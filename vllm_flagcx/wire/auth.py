"""Side-channel authentication: an HMAC-SHA256 tag over every message, keyed by a secret
that prefill, decode and the router share.

The tag authenticates the sender and the content; it does not hide it, and a server
must take a message in before it can check one. So with a secret the connection is also
ZMQ CURVE, keys derived from the same secret (``curve``): strangers are refused in the
connection's handshake, the content is encrypted, replays from another connection fail.
The tag stays: it is the one check where libzmq lacks CURVE (no libsodium), and it ties
each message to the secret on top of the session. One shared secret, set the same way on
every instance, is what an operator of a PD deployment can actually manage.

Frame on the wire: ``MAGIC + tag(32 bytes) + payload`` with a secret, the bare msgpack
payload without one. A msgpack message never starts with ``MAGIC`` (a struct encodes as a
map or array), so each side can tell which kind it got and say what is misconfigured.

Pure functions: no sockets here. The secret is never logged or put in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from vllm_flagcx.wire.handshake import HandshakeError

# Not VLLM_-prefixed: vLLM warns about every VLLM_* variable it does not know, and
# refuses to start with --fail-on-environ-validation. The old name is still read.
SECRET_ENV = "FLAGCX_SIDE_CHANNEL_SECRET"
LEGACY_SECRET_ENV = "VLLM_FLAGCX_SIDE_CHANNEL_SECRET"
# A file, not the secret itself: vLLM logs its kv_transfer_config (extra config included)
# at startup, so a secret written there would end up in every log.
SECRET_FILE_KEY = "side_channel_secret_file"  # kv_connector_extra_config key
MAGIC = b"FXA1"
TAG_BYTES = 32
MIN_SECRET_CHARS = 16
HOW_TO_SET = (f"set the same secret on prefill, decode and the router: the environment "
              f"variable {SECRET_ENV}, or a file named by "
              f"kv_connector_extra_config.{SECRET_FILE_KEY} (at least {MIN_SECRET_CHARS} "
              "characters)")


class AuthError(HandshakeError):
    """A side-channel frame failed authentication, or the secret is unusable."""


ROUTER_CREDENTIAL_TAG = "flagcx-router-credential-v1"


class RouterCredential(NamedTuple):
    """What the router holds instead of the secret: a MAC key derived one way from the
    secret's (``router_mac``: no decode or server key can be derived from it, so it
    cannot pull, renew a lease or pose as prefill) and prefill's public CURVE key (the
    router checks who answers). Prefill derives the same MAC key and lets its holder
    handshake and release only."""

    mac: bytes
    server_public: bytes

    def text(self) -> str:
        return f"{ROUTER_CREDENTIAL_TAG} {self.mac.hex()} {self.server_public.decode()}"

    @classmethod
    def parse(cls, text: str) -> RouterCredential | None:
        """The credential ``text`` holds, or None when it is not one (a plain secret)."""
        fields = text.split()
        if len(fields) != 3 or fields[0] != ROUTER_CREDENTIAL_TAG:
            return None
        try:
            mac = bytes.fromhex(fields[1])
        except ValueError:
            return None
        if len(mac) != 32 or len(fields[2]) != 40:
            return None
        return cls(mac, fields[2].encode())


Key = bytes | RouterCredential | None  # the full MAC key, the router's, or none


def router_mac(key: bytes) -> bytes:
    """The router's MAC key: one way from the full one."""
    return hashlib.sha256(b"vllm-flagcx router\0" + key).digest()


def mac_of(key: Key) -> bytes | None:
    return key.mac if isinstance(key, RouterCredential) else key


def load_key(secret_file: str | None = None, environ: Mapping[str, str] | None = None
             ) -> bytes | None:
    """The MAC key: from ``secret_file`` if given, else the environment variable; None
    when neither is set. A secret shorter than ``MIN_SECRET_CHARS`` or an unreadable file
    is refused (AuthError naming where it came from, never the value)."""
    found = read_secret(secret_file, environ)
    return None if found is None else key_of(*found)


def key_of(source: str, secret: str) -> bytes:
    if len(secret) < MIN_SECRET_CHARS:
        raise AuthError(f"{source}: the secret has {len(secret)} characters; use at least "
                        f"{MIN_SECRET_CHARS} (e.g. `python -c 'import secrets; "
                        "print(secrets.token_urlsafe(32))'`)")
    return hashlib.sha256(b"vllm-flagcx side channel\0" + secret.encode()).digest()


def read_secret(secret_file: str | None = None, environ: Mapping[str, str] | None = None
                ) -> tuple[str, str] | None:
    """(where it came from, the text) of the secret file or variable; None if unset."""
    environ = os.environ if environ is None else environ
    if secret_file:
        source = f"kv_connector_extra_config.{SECRET_FILE_KEY}={secret_file!r}"
        try:
            mode = os.stat(secret_file).st_mode
        except OSError as exc:
            raise AuthError(f"{source}: cannot read it ({exc.strerror}); name a readable "
                            "file that holds the secret") from None
        if mode & 0o077:
            raise AuthError(f"{source}: the file is open to other users (mode "
                            f"{mode & 0o777:o}); `chmod 600` it so only the engine's user "
                            "can read the secret")
        try:
            secret = Path(secret_file).read_text().strip()
        except OSError as exc:
            raise AuthError(f"{source}: cannot read it ({exc.strerror}); name a readable "
                            "file that holds the secret") from None
        if not secret:
            raise AuthError(f"{source}: the file is empty")
    else:
        source, secret = SECRET_ENV, environ.get(SECRET_ENV, "").strip()
        if not secret and environ.get(LEGACY_SECRET_ENV, "").strip():
            source, secret = LEGACY_SECRET_ENV, environ[LEGACY_SECRET_ENV].strip()
            logging.getLogger("vllm_flagcx").warning(
                "%s is deprecated: vLLM flags unknown VLLM_* variables (and refuses them "
                "with --fail-on-environ-validation); set %s instead", LEGACY_SECRET_ENV,
                SECRET_ENV)
        if not secret:
            return None
    return source, secret


def seal(key: Key, payload: bytes) -> bytes:
    """The frame to send: ``payload`` tagged under ``key`` (unchanged without a key)."""
    key = mac_of(key)
    if key is None:
        return payload
    return MAGIC + hmac.new(key, payload, hashlib.sha256).digest() + payload


def unseal(key: Key, frame: bytes) -> bytes:
    """The payload of a received frame whose tag verifies under ``key``.

    AuthError says which side lacks or differs in the secret; the payload of a frame that
    fails is never looked at.
    """
    sealed = frame.startswith(MAGIC)
    key = mac_of(key)
    if key is None:
        if sealed:
            raise AuthError("the peer authenticates its side-channel messages but this "
                            f"instance has no secret; {HOW_TO_SET}")
        return frame
    if not sealed or len(frame) < len(MAGIC) + TAG_BYTES:
        raise AuthError("unauthenticated side-channel message: this instance requires a "
                        f"secret and the peer sent none; {HOW_TO_SET}")
    tag, payload = frame[len(MAGIC):len(MAGIC) + TAG_BYTES], frame[len(MAGIC) + TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(key, payload, hashlib.sha256).digest()):
        raise AuthError("side-channel message failed authentication: the peer's secret "
                        f"differs from this instance's; {HOW_TO_SET}")
    return payload


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; False for anything else, wildcard
    binds (0.0.0.0, ::, *) included."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_secret_off_loopback(bind_host: str, key: bytes | None) -> None:
    """Refuse an unauthenticated side channel on a routable address: whoever reaches the
    port could otherwise read layout facts and steer writes into this instance's KV."""
    if key is None and not is_loopback(bind_host):
        raise AuthError(f"side_channel_bind={bind_host!r} without a secret: an "
                        "unauthenticated side channel is only served on loopback "
                        f"(127.0.0.1, ::1). {HOW_TO_SET[0].upper()}{HOW_TO_SET[1:]}, or "
                        "bind 127.0.0.1 for a single-host deployment")
