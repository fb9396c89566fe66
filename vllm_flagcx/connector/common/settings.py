"""``kv_connector_extra_config``: every key the connector reads, checked once at startup.

A value of the wrong kind or range is refused naming the key, the value and what is
allowed (measured before: ``lease_seconds <= 0`` busy-looped decode's heartbeats, port
70000 bound a wrapped port, the string "false" read as true, a negative timeout stranded
requests inside a pull thread). Unknown keys are logged with the closest known one: a
misspelled key used to be ignored silently.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("vllm_flagcx")


class SettingsError(ValueError):
    """A ``kv_connector_extra_config`` value the connector cannot use."""


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise SettingsError(f"kv_connector_extra_config.{key}={value!r}: use true or false")


def _seconds(key: str, value: object) -> float:
    try:
        number = float(value) if isinstance(value, (int, float, str)) else math.nan
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
        raise SettingsError(f"kv_connector_extra_config.{key}={value!r}: use a number of "
                            "seconds > 0")
    return number


def _seconds_or_off(key: str, value: object) -> float:
    """Seconds >= 0, where 0 switches the thing off."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    try:
        return _seconds(key, value)
    except SettingsError:
        raise SettingsError(f"kv_connector_extra_config.{key}={value!r}: use a number of "
                            "seconds >= 0 (0: off)") from None


def _port(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SettingsError(f"kv_connector_extra_config.{key}={value!r}: use a TCP port "
                            "1..65535")
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise SettingsError(f"kv_connector_extra_config.{key}={value!r}: use a TCP port "
                            "1..65535")
    return port


def _text(key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SettingsError(f"kv_connector_extra_config.{key}={value!r}: use a non-empty "
                            "string")
    return value.strip()


def _choice(*allowed: str) -> Callable[[str, object], str]:
    def check(key: str, value: object) -> str:
        if value not in allowed:
            raise SettingsError(f"kv_connector_extra_config.{key}={value!r}: use one of "
                                f"{', '.join(allowed)}")
        return str(value)
    return check


# ``transport``: "auto" or a built-in transport (``transport_choice.BUILT_IN``, one each)
TRANSPORT_NAMES = ("auto", "flagcx", "local")

KEYS: dict[str, Callable[[str, object], object]] = {
    "transport": _choice(*TRANSPORT_NAMES),
    "transport_factory": _text,
    "flagcx_library": _text,
    "flagcx_rdma_check": _bool,
    "verify_integrity": _bool,
    "side_channel_host": _text,
    "side_channel_bind": _text,
    "side_channel_port": _port,
    "lease_seconds": _seconds,
    "first_lease_seconds": _seconds,
    "recv_timeout": _seconds,
    "handshake_timeout": _seconds,
    "write_start_timeout": _seconds,
    "release_hold_seconds": _seconds,
    "idle_step_wait_seconds": _seconds_or_off,
    "enforce_handshake_compat": _bool,
    "test_faults": _bool,
    "log_timelines": _bool,
    "side_channel_secret_file": _text,
}


def checked_extra_config(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The extra config with every known key converted and checked (SettingsError names
    the first bad one); unknown keys are kept, and logged once with a suggestion."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise SettingsError(f"kv_connector_extra_config must be an object, got "
                            f"{type(extra).__name__}")
    out: dict[str, Any] = {}
    for key, value in extra.items():
        check = KEYS.get(key)
        if check is None:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            logger.warning("FlagCXConnector: kv_connector_extra_config.%s is not a setting "
                           "of this connector; ignored%s", key,
                           f" (did you mean {close[0]!r}?)" if close else "")
            out[key] = value
        elif value is not None:
            out[key] = check(key, value)
    return out


DEFAULT_SIDE_CHANNEL_PORT = 5600
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ConnectorSettings:
    """Every ``kv_connector_extra_config`` key, read once, checked, with its default stated
    here and nowhere else (docs/settings.md lists the same)."""

    transport: str = "auto"
    transport_factory: str | None = None
    flagcx_library: str | None = None
    flagcx_rdma_check: bool = True
    verify_integrity: bool = True
    side_channel_host: str = LOOPBACK
    side_channel_bind: str | None = None  # None: side_channel_host
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    lease_seconds: float = 30.0
    # P: a finished request's blocks are held this long until decode shows it has the
    # request (its first heartbeat or pull), then ``lease_seconds``: a decode leg that never
    # reaches decode (an external router's failed leg) frees them this soon. 30 s, not
    # shorter: on a starved 2-core CPU engine decode's first word came later than 10 s in
    # 5 cases of an independent check (all came within 30 s)
    first_lease_seconds: float = 30.0
    recv_timeout: float | None = None  # None: lease_seconds + 10
    handshake_timeout: float = 10.0  # 5 s once ran out behind a CPU-starved prefill
    # P: a write still queued this long after its pull was claimed is not started
    write_start_timeout: float = 5.0
    # D: a failed pull's blocks stay held (Release retried) until prefill confirms that no
    # write into them is in flight, or its port refuses connections, at most this long
    release_hold_seconds: float = 600.0
    # both: a step that computes no token waits up to this long for the transfers in
    # flight on the connector's threads (``connector.in_flight``); 0: never waits
    idle_step_wait_seconds: float = 0.005
    enforce_handshake_compat: bool = True
    test_faults: bool = False
    # D: one wire.timeline line per load at INFO (where a request's time goes); else DEBUG
    log_timelines: bool = False
    side_channel_secret_file: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)  # unknown keys too

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        checked = checked_extra_config(extra)
        known = {k: v for k, v in checked.items() if k in KEYS}
        return cls(**known, raw=checked)

    @property
    def initial_lease(self) -> float:
        """How long prefill holds a finished request's blocks before decode's first word."""
        return min(self.first_lease_seconds, self.lease_seconds)

    @property
    def bind_host(self) -> str:
        return self.side_channel_bind or self.side_channel_host

    @property
    def pull_timeout(self) -> float:
        """Longer than the prefill lease, so a lease ends before decode gives up."""
        return self.recv_timeout if self.recv_timeout is not None else self.lease_seconds + 10


# Every user default in one instance: the worker's and the scheduler's settings take
# theirs from it, so each default is stated once (in the class above).
DEFAULTS = ConnectorSettings()
