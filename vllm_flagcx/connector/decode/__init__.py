"""Decode's half of a transfer: the pulls it makes (``puller``, ``pull_clock``), each load's
lifecycle as the scheduler sees it (``loads``), what failed until vLLM is told
(``ledger``), and the test-only faults on the receive (``fault_knobs``). Never imports
``connector.prefill``."""
