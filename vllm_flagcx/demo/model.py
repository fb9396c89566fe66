"""The demo's tiny model, generated locally: a config and a byte-level BPE tokenizer.

No hub access: the weights are drawn from a fixed seed here (vLLM's ``--load-format
dummy`` draws them so small that every prompt decodes to the same tokens, which would make
a PD-vs-monolithic comparison blind), scaled to keep activations O(1) so greedy output
depends on every token of the prompt. Prefill, decode and the monolithic engine load the
same file, so their greedy outputs are comparable token for token. The Llama models are
untied, with embeddings drawn small (``EMBED_SCALE``) and a high-gain head
(``HEAD_GAIN``): tied to unit-scale embeddings, the residual stream was the last token's
own embedding and greedy output repeated it whatever the KV (`' is is is'`), so PD ==
monolithic held with wrong KV too (``tests/test_demo_model.py`` guards this). The layer
mix gives
vLLM's hybrid KV cache manager two KV cache groups (sliding-window and full attention),
which is what the connector has to move per group. head_dim 64: the CPU attention kernel
rejects 16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
SLIDING_WINDOW = 64
EMBED_SCALE = 0.1  # attention and MLP outputs, which read the context, dominate the residual
HEAD_GAIN = 16.0  # wide logit margins: greedy picks survive kernel rounding differences
CORPUS = """\
The prefill instance computes the prompt, the decode instance generates the answer.
A KV connector moves the cache between them. One hundred plus one hundred is two hundred.
Tell me a story about a dragon who lives in a data center and loves fast networks.
What is the capital of France? Paris is the capital of France, and Berlin of Germany.
0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } , . ; : ! ? ' " # @ % & < >
def main(): return sum(range(10)) if __name__ == "__main__" else None
Les modeles de langue generent du texte. Sprachmodelle erzeugen Text.
"""


def model_config(kind: str = "sliding") -> dict:
    """config.json for a 4-layer Llama whose layers alternate sliding/full attention."""
    layers = ["sliding_attention", "full_attention"] * 2
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": VOCAB_SIZE, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": len(layers), "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }
    if kind == "hybrid":
        return hybrid_config()
    if kind == "mamba2":
        return mamba2_config()
    if kind == "sliding":
        config |= {"layer_types": layers, "sliding_window": SLIDING_WINDOW}
    elif kind != "dense":
        raise ValueError(f"model kind {kind!r}: use one of {', '.join(KINDS)}")
    return config


def hybrid_config() -> dict:
    """A Qwen3-Next (Qwen3.5/3.6 family) layer mix at toy size: [3 Gated DeltaNet + 1 full
    attention] x 2, so vLLM's hybrid KV cache manager makes one attention group and three
    GDN groups, whose conv + ssm state the connector moves. vLLM's Qwen3-Next needs at
    least one MoE layer; the others use a dense MLP (``mlp_only_layers``), which keeps the
    toy model small (experts are irrelevant to what moves between P and D)."""
    layers = (["linear_attention"] * 3 + ["full_attention"]) * 2
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": VOCAB_SIZE, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": len(layers), "layer_types": layers,
        "full_attention_interval": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1, "norm_topk_prob": True,
        "mlp_only_layers": list(range(len(layers) - 1)), "max_position_embeddings": 4096,
        # Untied, as in Qwen3-Next/Qwen3.6 checkpoints: vLLM 0.22's Qwen3-Next builds its
        # own lm_head whatever the flag says, and a tied checkpoint (no lm_head.weight)
        # left it all zeros: every logit 0, greedy token 0, empty outputs.
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }


def mamba2_config() -> dict:
    """A Nemotron-H (Mamba2 + attention) layer mix at toy size, ``M-M*M-M*``: four Mamba2
    layers, two attention layers, two MLPs.

    The GPU suite's float32 hybrid: vLLM 0.22's CUDA Gated DeltaNet prefill kernel refuses
    float32, its Mamba2 kernels do not, so this is the hybrid whose PD run can be held to
    exact equality with the monolithic one (no bf16 near ties). The connector moves its
    Mamba2 conv + ssm page exactly as it moves a GDN one. Nemotron-H, not Bamba: vLLM
    0.22's Bamba reads layer kinds that transformers 5 renamed; its Nemotron-H config is
    vLLM's own class (these key names), which transformers 5 also reads."""
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": VOCAB_SIZE, "hidden_size": 256, "intermediate_size": 512,
        "hybrid_override_pattern": "M-M*M-M*", "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "mamba_num_heads": 8, "mamba_head_dim": 64, "mamba_n_groups": 1,
        "ssm_state_size": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_chunk_size": 256, "mlp_hidden_act": "relu2",
        "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
    }


# transformers' NemotronHConfig spells four of the Mamba2 fields without the prefix.
_HF_NEMOTRON_H_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
                        "mamba_expand": "expand", "mamba_chunk_size": "chunk_size"}


KINDS = ("hybrid", "mamba2", "sliding", "dense")


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    return tokenizer.to_str()


WEIGHTS_SEED = 20261202


def weights(config: dict) -> dict:
    """Seeded weights in the Hugging Face naming (fp32, ~12 MB for this size)."""
    import torch

    if config["model_type"] in ("qwen3_next", "nemotron_h"):
        return _hybrid_weights(config)

    gen = torch.Generator().manual_seed(WEIGHTS_SEED)
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], \
        config["num_key_value_heads"]
    head_dim, inter = config["head_dim"], config["intermediate_size"]

    def linear(out: int, inp: int) -> torch.Tensor:
        return _unit_gain((out, inp), gen)

    out = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden,
                                                    generator=gen) * EMBED_SCALE,
           "model.norm.weight": torch.ones(hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        out |= {
            prefix + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": linear(kv * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": linear(kv * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": linear(inter, hidden),
            prefix + "mlp.up_proj.weight": linear(inter, hidden),
            prefix + "mlp.down_proj.weight": linear(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    out["lm_head.weight"] = _unit_gain((config["vocab_size"], hidden), gen) * HEAD_GAIN
    return out


def _unit_gain(shape: Any, gen: Any) -> Any:
    """A (out, in) matrix drawn from ``gen`` with unit gain: activations stay O(1)."""
    import torch

    return torch.randn(tuple(shape), generator=gen) / shape[-1] ** 0.5


def _hybrid_weights(config: dict) -> dict:
    """Transformers' own Qwen3-Next or Nemotron-H parameters (names, shapes, the A_log/
    dt_bias/conv init of GDN and Mamba2), with every matrix redrawn from the seed at unit gain like
    the Llama weights."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(WEIGHTS_SEED)
    # transformers' own config class, not AutoConfig.for_model: once vLLM 0.20 has loaded
    # a Qwen3-Next config in this process, the latter no longer gives one that
    # transformers' modeling code can read (rope_theta missing).
    if config["model_type"] == "qwen3_next":
        hf_config = transformers.Qwen3NextConfig(**config)
    else:
        hf_config = transformers.NemotronHConfig(
            **{_HF_NEMOTRON_H_NAMES.get(k, k): v for k, v in config.items()})
    hf = AutoModelForCausalLM.from_config(hf_config)
    gen = torch.Generator().manual_seed(WEIGHTS_SEED)
    out = {}
    for name, tensor in hf.state_dict().items():
        # Fused experts ((E, 2I, H) gate||up, (E, H, I) down) go out per expert, in the
        # names vLLM's loader maps.
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[:-len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = _unit_gain(tensor[e, :half].shape, gen)
                out[f"{prefix}{e}.up_proj.weight"] = _unit_gain(tensor[e, half:].shape, gen)
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = _unit_gain(tensor[e].shape, gen)
        elif tensor.ndim == 2:
            out[name] = _unit_gain(tensor.shape, gen)
        else:
            out[name] = tensor.detach().float().contiguous()
    return out  # lm_head included: vLLM's Qwen3-Next always loads its own (hybrid_config)


def write_model(directory: Path, kind: str = "sliding") -> Path:
    """Write the model into ``directory`` (idempotent) and return it. Needs torch and
    safetensors (both come with vLLM)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = json.dumps(model_config(kind), indent=2)
    if (directory / "config.json").exists() and (
            directory / "config.json").read_text() == config and (
            directory / "model.safetensors").exists():
        return directory
    from safetensors.torch import save_file

    save_file(weights(model_config(kind)), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(directory)
    (directory / "config.json").write_text(config)
    return directory


def write_tokenizer(directory: Path, max_length: int = 4096) -> None:
    """The demo's tokenizer and generation config into ``directory`` (B5's real-width
    models share them, with their own ``max_length``)."""
    (directory / "tokenizer.json").write_text(_tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>", "model_max_length": max_length, "add_bos_token": False,
        "clean_up_tokenization_spaces": False}, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1}))
