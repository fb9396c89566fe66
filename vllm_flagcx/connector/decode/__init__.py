"""Decode's half of a transfer: the pulls it makes (``puller``; its clock is
``wire.timeline.PullClock``), each load's lifecycle as the scheduler sees it (``loads``),
and what goes wrong on the receive (``faults``: failures until vLLM is told, and the
test-only faults). Never imports ``connector.prefill``."""
