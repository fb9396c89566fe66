"""B5's models of the target's real width, loaded with random weights (no hub).

The demo's toy model (hidden 256) makes every fixed cost of PD dominate and hides what PD
is for. These have the per-layer shape of the real models, with fewer layers so that a
prefill and a decode engine fit one 80 GB GPU:

* ``hybrid-wide``: Qwen3.6-35B-A3B's layer (Qwen3-Next architecture, which vLLM 0.22
  serves): hidden 2048, full attention 16 Q / 2 KV heads of dim 256 (partial rotary 0.25),
  Gated DeltaNet 16 QK / 32 V heads of dim 128, conv 4, 256 experts of width 512, 8 routed
  + 1 shared; [3 GDN + 1 full attention] x 2 (the target has x 10);
* ``dense-wide``: a Llama-3-8B layer (hidden 4096, 32 Q / 8 KV heads of 128, MLP 14336),
  8 of its 32 layers, full attention (FLASH_ATTN).

The engines load them with ``--load-format dummy`` (vLLM draws the weights): B5 measures
time, not answers, and asks for ``ignore_eos``. The vocabulary is the demo tokenizer's 512
tokens (the real 248k-row head adds ~0.5 GFLOP a token, on both PD and monolithic).
``max_position_embeddings`` covers every prompt B5 sends (``check_prompt_fits``), so the
engines run in their range in vLLM's default CUDA graph mode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_POSITIONS = 65536

HYBRID_WIDE: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 512, "hidden_size": 2048, "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "intermediate_size": 512, "decoder_sparse_step": 1, "norm_topk_prob": True,
    "mlp_only_layers": [], "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
}

DENSE_WIDE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 512, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 1,
}

MODELS = {"hybrid-wide": HYBRID_WIDE, "dense-wide": DENSE_WIDE}
# what each needs of vLLM 0.22's CUDA engine besides the common B5 arguments: the
# FlashInfer GDN / MoE paths JIT-compile for minutes on a machine without their cubins
ENGINE_ARGS = {"hybrid-wide": ("--gdn-prefill-backend", "triton", "--moe-backend", "triton"),
               "dense-wide": ()}


def write(directory: Path, kind: str) -> Path:
    """config.json and the demo tokenizer into ``directory``; no weights."""
    from vllm_flagcx.demo import model as demo_model

    if kind not in MODELS:
        raise ValueError(f"B5 model {kind!r}: use one of {', '.join(MODELS)}")
    directory.mkdir(parents=True, exist_ok=True)
    demo_model.write_tokenizer(directory, max_length=MAX_POSITIONS)
    (directory / "config.json").write_text(json.dumps(MODELS[kind], indent=2))
    return directory


def check_prompt_fits(kind: str, prompt_tokens: int, max_tokens: int) -> None:
    """Refuse a prompt the model's positions do not cover (eager mode reads the rotary
    table out of bounds without a word; graph mode dies on a device assert)."""
    limit = MODELS[kind]["max_position_embeddings"]
    if prompt_tokens + max_tokens > limit:
        raise ValueError(f"B5: a {prompt_tokens}-token prompt + {max_tokens} tokens exceeds "
                         f"{kind}'s max_position_embeddings={limit}: lower the prompt size "
                         "or raise MAX_POSITIONS")
