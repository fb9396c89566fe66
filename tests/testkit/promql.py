"""A small PromQL evaluator for the queries dashboards put on PD panels, run against two
real scrapes of ``/metrics`` (Prometheus text format), so a test can say whether a panel
would show data. Stand-in for a Prometheus server (none installs from the package
registry); it covers what the shipped dashboards and NIXL's PD panels use: selectors with
``=``, ``!=``, ``=~``, ``!~``; ``rate`` and ``increase`` over a range (the two scrapes are
the range); ``sum`` with or without ``by``; ``histogram_quantile`` (Prometheus'
interpolation); ``+ - * /`` between vectors (matched on equal labels) and numbers.
Anything else raises ``PromQLError`` naming the text, so a panel this cannot read fails
the test instead of passing unread.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from testkit.promql_vectors import Labels, Vector, binary, quantile, select


class PromQLError(ValueError):
    """A query outside the supported subset, or malformed."""


@dataclass(frozen=True)
class Scrape:
    seconds: float  # when it was taken
    series: dict[Labels, float]


def parse_exposition(text: str, **extra_labels: str) -> dict[Labels, float]:
    """Series of one ``/metrics`` text; ``extra_labels`` (e.g. instance) as a scraper
    adds them."""
    out: dict[Labels, float] = {}
    line_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\d+)?$")
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = line_re.match(line)
        if match is None:
            raise PromQLError(f"not an exposition line: {line[:120]!r}")
        labels = dict(label_re.findall(match.group(3) or ""))
        labels.update(extra_labels, __name__=match.group(1))
        out[frozenset(labels.items())] = float(match.group(4))
    return out


_TOKEN = re.compile(r"\s*(?:(?P<dur>\d+[smhdw])\b|(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)"
                    r"|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<str>\"(?:[^\"\\]|\\.)*\")|(?P<op>=~|!~|!=|[-+*/(){}\[\],=]))")


def _tokens(query: str) -> list[str]:
    out, pos = [], 0
    query = query.strip()
    while pos < len(query):
        match = _TOKEN.match(query, pos)
        if match is None or match.end() == pos:
            raise PromQLError(f"cannot read {query[pos:pos + 30]!r} in {query!r}")
        out.append(match.group(match.lastgroup or "op"))
        pos = match.end()
    return out


@dataclass(frozen=True)
class _Range:
    matchers: tuple[tuple[str, str, str], ...]


class _Parser:
    """Recursive descent over the subset; evaluates as it parses."""

    def __init__(self, query: str, before: Scrape, after: Scrape) -> None:
        self.query, self.tokens, self.pos = query, _tokens(query), 0
        self.before, self.after = before, after

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise PromQLError(f"expected {expected or 'more'} in {self.query!r}, got {token!r}")
        self.pos += 1
        return token

    def parse(self) -> Vector | float:
        value = self.expr()
        if self.peek() is not None:
            raise PromQLError(f"unread {self.tokens[self.pos:]} in {self.query!r}")
        return value

    def expr(self) -> Vector | float:
        value = self.term()
        while self.peek() in ("+", "-", "*", "/"):
            op = self.take()
            value = binary(op, value, self.term())
        return value

    def term(self) -> Vector | float:
        token = self.take()
        if token == "(":
            value = self.expr()
            self.take(")")
            return value
        if re.fullmatch(r"\d.*", token):
            return float(token)
        if token == "sum":
            return self.aggregate()
        if token in ("rate", "increase"):
            self.take("(")
            rng = self.selector(self.take())
            self.take(")")
            if not isinstance(rng, _Range):
                raise PromQLError(f"{token} needs a range selector in {self.query!r}")
            return self.over_range(rng, per_second=token == "rate")
        if token == "histogram_quantile":
            self.take("(")
            q = self.expr()
            self.take(",")
            vector = self.expr()
            self.take(")")
            if not isinstance(q, float) or not isinstance(vector, dict):
                raise PromQLError(f"histogram_quantile(scalar, vector) in {self.query!r}")
            return quantile(q, vector)
        value = self.selector(token)
        if isinstance(value, _Range):
            raise PromQLError(f"a range outside rate/increase in {self.query!r}")
        return value

    def labels_list(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take(",")
        self.take(")")
        return tuple(names)

    def aggregate(self) -> Vector:
        by: tuple[str, ...] | None = None
        if self.peek() == "by":
            self.take()
            by = self.labels_list()
        self.take("(")
        inner = self.expr()
        self.take(")")
        if self.peek() == "by":
            self.take()
            by = self.labels_list()
        if not isinstance(inner, dict):
            raise PromQLError(f"sum over a scalar in {self.query!r}")
        out: Vector = {}
        for labels, value in inner.items():
            key = frozenset((k, v) for k, v in labels if by is not None and k in by)
            out[key] = out.get(key, 0.0) + value
        return out

    def selector(self, name: str) -> Vector | _Range:
        if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name):
            raise PromQLError(f"{name!r} is not a metric name in {self.query!r}")
        matchers = [("__name__", "=", name)]
        if self.peek() == "{":
            self.take("{")
            while self.peek() != "}":
                label, op, text = self.take(), self.take(), self.take()
                if op not in ("=", "!=", "=~", "!~") or not text.startswith('"'):
                    raise PromQLError(f"bad matcher {label}{op}{text} in {self.query!r}")
                matchers.append((label, op, text[1:-1].encode().decode("unicode_escape")))
                if self.peek() == ",":
                    self.take(",")
            self.take("}")
        if self.peek() == "[":
            self.take("[")
            self.take()  # the duration: the two scrapes are the range
            self.take("]")
            return _Range(tuple(matchers))
        return select(self.after.series, matchers, keep_name=True)

    def over_range(self, rng: _Range, per_second: bool) -> Vector:
        old = select(self.before.series, list(rng.matchers), keep_name=False)
        new = select(self.after.series, list(rng.matchers), keep_name=False)
        span = self.after.seconds - self.before.seconds
        if span <= 0:
            raise PromQLError("the second scrape must come after the first")
        return {labels: (value - old[labels]) / (span if per_second else 1.0)
                for labels, value in new.items() if labels in old}


def evaluate(query: str, before: Scrape, after: Scrape) -> Vector | float:
    return _Parser(query, before, after).parse()


def has_data(result: Vector | float) -> bool:
    """What Grafana draws: some finite value."""
    values = result.values() if isinstance(result, dict) else [result]
    return any(math.isfinite(v) for v in values)
