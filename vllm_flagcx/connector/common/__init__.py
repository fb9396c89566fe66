"""What both halves share: settings, the per-step metadata contract, what a worker
registered, counters and observations, integrity checks, the transport choice, and the
threads the connector runs on."""
