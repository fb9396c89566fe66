"""Instant-vector operations of the PromQL subset ``testkit.promql`` evaluates (a
stand-in for a Prometheus server): label matching, arithmetic between vectors and
numbers, and ``histogram_quantile`` with Prometheus' interpolation. A vector maps a
label set (``__name__`` included) to its value.
"""

from __future__ import annotations

import math
import re

Labels = frozenset  # of (name, value) pairs; "__name__" is the metric name
Vector = dict


def _matches(value: str, op: str, text: str) -> bool:
    if op == "=":
        return value == text
    if op == "!=":
        return value != text
    found = re.fullmatch(text, value) is not None
    return found if op == "=~" else not found


def select(series: dict[Labels, float], matchers: list[tuple[str, str, str]],
            keep_name: bool) -> Vector:
    out: Vector = {}
    for labels, value in series.items():
        names = dict(labels)
        if all(_matches(names.get(k, ""), op, text) for k, op, text in matchers):
            out[labels if keep_name else frozenset(
                (k, v) for k, v in labels if k != "__name__")] = value
    return out


def binary(op: str, left: Vector | float, right: Vector | float) -> Vector | float:
    def apply(a: float, b: float) -> float:
        if op == "/":
            return math.nan if b == 0 else a / b
        return {"+": a + b, "-": a - b, "*": a * b}[op]

    if isinstance(left, float) and isinstance(right, float):
        return apply(left, right)
    if isinstance(left, float):
        assert isinstance(right, dict)
        return {k: apply(left, v) for k, v in right.items()}
    if isinstance(right, float):
        return {k: apply(v, right) for k, v in left.items()}
    strip = lambda labels: frozenset((k, v) for k, v in labels if k != "__name__")  # noqa: E731
    rights = {strip(k): v for k, v in right.items()}
    return {strip(k): apply(v, rights[strip(k)]) for k, v in left.items()
            if strip(k) in rights}


def quantile(q: float, vector: Vector) -> Vector:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the rank."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in vector.items():
        names = dict(labels)
        if "le" not in names:
            continue
        key = frozenset((k, v) for k, v in labels if k not in ("le", "__name__"))
        groups.setdefault(key, []).append((float(names["le"]), count))
    out: Vector = {}
    for key, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1]
        if not buckets or not math.isinf(buckets[-1][0]) or total <= 0:
            out[key] = math.nan
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for upper, count in buckets:
            if count >= rank:
                if math.isinf(upper):
                    out[key] = lower
                else:
                    out[key] = lower + (upper - lower) * (rank - below) / max(count - below,
                                                                              1e-12)
                break
            lower, below = upper, count
    return out
