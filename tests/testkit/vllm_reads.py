"""What the tests read from vLLM that the product never does: vLLM's own failure policy for
a failed load, and which requests a step resumed. Test-only, so they live in the test kit
and their capability probes are informational (``required=False``): a vendor build that
lacks them still runs the connector.
"""

from __future__ import annotations

from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.config import kv_transfer_field


def failure_policy(kv_transfer_config: Any) -> str:
    """"recompute" or "fail": what vLLM does with blocks reported as failed."""
    default = capabilities().kv_load_failure_policy_default
    return str(kv_transfer_field(kv_transfer_config, "kv_load_failure_policy", default))


def resumed_request_ids(scheduler_output: Any, seen_new_before: set[str]) -> set[str]:
    """Ids of requests resumed after preemption in this step.

    ``seen_new_before`` is the caller's record of requests it already saw as new; on 0.34
    a resumed request arrives as new again, which is how it is recognised there.
    """
    cached = scheduler_output.scheduled_cached_reqs
    if capabilities().resumed_requests == "resumed_req_ids":
        return set(getattr(cached, "resumed_req_ids", ()) or ())
    return {r.req_id for r in scheduler_output.scheduled_new_reqs if r.req_id in seen_new_before}
