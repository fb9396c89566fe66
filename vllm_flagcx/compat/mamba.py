"""Mamba/GDN specifics: conv state layout and the N-1 token rule for P/D.

A recurrent state cannot be "partly recomputed": decode must run the last prompt token
itself to derive the state after it. So prefill computes the state after N-1 prompt tokens
and decode recomputes token N (the rule vLLM's NIXL connector adopted in 0.19).

Conv layout: "SD" (state_len, dim) per block is vLLM's default; "DS" (dim, state_len) is
selected by ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` from 0.17. 0.13 has SD only.
"""

from __future__ import annotations

from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import optional
from vllm_flagcx.wire.params import seeds_first_token

TRUNCATED_KEY = "_flagcx_p_side_truncated"


def conv_state_layout() -> str:
    """"SD" or "DS": how this build stores Mamba conv state."""
    if capabilities().conv_state_layouts == "SD":
        return "SD"
    return "DS" if optional("is_conv_state_dim_first")() else "SD"


def remote_prefill_token_count(num_prompt_tokens: int, has_mamba: bool,
                               held: int | None = None) -> int | None:
    """Tokens decode loads from prefill: N, or N-1 when Mamba/GDN groups exist, and never
    more than the ``held`` tokens prefill says it computed.

    Decode seeded with prefill's first token holds N + 1 prompt tokens, prefill held N:
    decode loads N and computes only the seed. A recurrent state is the state after
    exactly ``held`` tokens, so with Mamba/GDN groups anything but an exact match is
    None: nothing can be loaded, decode computes the prompt itself."""
    wanted = num_prompt_tokens - 1 if has_mamba and num_prompt_tokens > 1 else num_prompt_tokens
    if held is None:
        return wanted
    if has_mamba:
        return wanted if wanted == held else None
    return min(wanted, held)


def truncate_for_prefill(request: Any, hash_block_size: int | None = None) -> bool:
    """Prefill side: drop the last prompt token once (idempotent under preemption).

    Returns True when this call truncated. Block hashes covering the dropped token are
    discarded too (``Request.truncate_block_hashes`` on 0.34, the same rule elsewhere), so
    a later prefix-cache lookup cannot match a block holding a token that was never run.
    """
    params = request.kv_transfer_params
    if (params is None or params.get(TRUNCATED_KEY) or request.num_prompt_tokens <= 1
            or seeds_first_token(params)):
        return False  # seeded: decode continues from prompt + [t1] (wire.params)
    if request.prompt_token_ids is not None:
        request.prompt_token_ids.pop()
    elif getattr(request, "prompt_embeds", None) is not None:
        request.prompt_embeds = request.prompt_embeds[:-1]
    else:
        return False
    request._all_token_ids.pop()
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params[TRUNCATED_KEY] = True
    if hash_block_size:
        if capabilities().truncate_block_hashes == "native":
            request.truncate_block_hashes(hash_block_size)
        elif getattr(request, "block_hashes", None) is not None:
            del request.block_hashes[request.num_tokens // hash_block_size:]
    return True
