"""Tiny random Hugging Face causal LMs of many architectures, built from configs (no downloads).

Each entry is a small config of one model family, sized so that a forward takes milliseconds: two
layers, hidden size 64, a 259-token vocabulary (the embedded tokenizer's: 256 bytes and three
specials). Weights come from a fixed seed, so two builds of one architecture are equal. Used to
check that what asyncpp computes matches plain Hugging Face runs on every family.
"""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 256,
    "bos_token_id": 257,
    "eos_token_id": 258,
    "tie_word_embeddings": False,
}

# family -> (config class, model class, config overrides)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "n_inner": 128},
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "final_logit_softcapping": 2.0, "sliding_window": 8},
    ),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 256}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
}


def tiny_config(arch: str) -> Any:
    """The config of the tiny model of family ``arch`` (a key of :data:`ARCHITECTURES`)."""
    import transformers

    try:
        config_cls, _, overrides = ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(f"no tiny model of {arch!r}; known: {', '.join(ARCHITECTURES)}") from None
    values = dict(_COMMON)
    if arch == "gpt2":  # GPT-2 names its sizes differently
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            values.pop(k)
    values.update(overrides)
    return getattr(transformers, config_cls)(**values)


def build_tiny(arch: str, seed: int = 0) -> Any:
    """A tiny random model of family ``arch``, in eval mode, float32, from a fixed seed."""
    import torch
    import transformers

    config = tiny_config(arch)
    model_cls = getattr(transformers, ARCHITECTURES[arch][1])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float().eval()
