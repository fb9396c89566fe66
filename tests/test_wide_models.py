"""B5's real-width models (``benchmarks/wide_models.py``): the shapes are the target's, the
config is one transformers reads, and a prompt past the declared positions is refused
before any engine starts (eager mode read the rotary table out of bounds silently; graph
mode died on a device assert)."""

from __future__ import annotations

import json

import pytest

from benchmarks import b5_engines, wide_models


def test_the_hybrid_has_the_target_layer_shape():
    c = wide_models.HYBRID_WIDE
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"]) == (2048, 16, 2, 256)
    assert (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
            c["linear_value_head_dim"], c["linear_conv_kernel_dim"]) == (16, 32, 128, 128, 4)
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
            c["shared_expert_intermediate_size"]) == (256, 8, 512, 512)
    assert c["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] \
        + ["linear_attention"] * 3 + ["full_attention"]
    assert len(c["layer_types"]) == c["num_hidden_layers"] and not c["mlp_only_layers"]


@pytest.mark.parametrize("kind", sorted(wide_models.MODELS))
def test_written_model_is_read_by_transformers_and_covers_every_b5_prompt(kind, tmp_path):
    import transformers

    model = wide_models.write(tmp_path / kind, kind)
    config = transformers.AutoConfig.from_pretrained(model)
    assert config.max_position_embeddings >= max(b5_engines.SIZES) + 16
    assert json.loads((model / "tokenizer_config.json").read_text())["model_max_length"] \
        == wide_models.MAX_POSITIONS
    assert b5_engines.one_token_bias(model)  # a plain ASCII token exists to bias to


def test_a_prompt_past_the_positions_is_refused_by_name():
    limit = wide_models.MAX_POSITIONS
    wide_models.check_prompt_fits("hybrid-wide", limit - 16, 16)
    with pytest.raises(ValueError, match="max_position_embeddings=65536"):
        wide_models.check_prompt_fits("hybrid-wide", limit - 15, 16)
    with pytest.raises(ValueError, match="use one of"):
        wide_models.write(__import__("pathlib").Path("/nonexistent"), "tiny")
