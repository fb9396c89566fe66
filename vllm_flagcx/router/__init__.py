"""The xPyD proxy that pairs a prefill and a decode instance per request (not built yet)."""
