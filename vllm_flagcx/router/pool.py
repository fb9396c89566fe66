"""Instances behind the router and the least-loaded choice among them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class RouterConfigError(ValueError):
    """A router setting that cannot work; the message names it and the fix."""


@dataclass
class Instance:
    """One vLLM server. ``side_channel_port`` is the prefill connector's base port when
    given on the command line (prefill also returns it in ``kv_transfer_params``)."""

    url: str
    role: str
    side_channel_port: int | None = None
    in_flight: int = 0
    served: int = 0
    failed: int = 0

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    def snapshot(self) -> dict[str, object]:
        return {"url": self.url, "in_flight": self.in_flight, "served": self.served,
                "failed": self.failed}


def parse_instance(spec: list[str], role: str) -> Instance:
    """``URL [SIDE_CHANNEL_PORT]`` as given to ``--prefill`` / ``--decode``."""
    if not spec or len(spec) > 2:
        raise RouterConfigError(f"--{role} takes URL [SIDE_CHANNEL_PORT], got {spec!r}")
    url = spec[0].rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
        raise RouterConfigError(f"--{role} {spec[0]!r}: give a URL with scheme, host and "
                                "port, e.g. http://127.0.0.1:20001")
    port = None
    if len(spec) == 2:
        if not spec[1].isdigit() or not 0 < int(spec[1]) < 65536:
            raise RouterConfigError(f"--{role} {url} {spec[1]!r}: SIDE_CHANNEL_PORT must be "
                                    "a TCP port (the connector's side_channel_port)")
        port = int(spec[1])
    return Instance(url, role, port)


@dataclass
class Pool:
    """Instances of one role; ``pick`` takes the one with the fewest requests in flight,
    rotating among equals so idle instances share the load."""

    role: str
    instances: list[Instance]
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if not self.instances:
            raise RouterConfigError(f"give at least one --{self.role} URL")

    def pick(self) -> Instance:
        least = min(i.in_flight for i in self.instances)
        idle = [i for i in self.instances if i.in_flight == least]
        return idle[next(self._turn) % len(idle)]
