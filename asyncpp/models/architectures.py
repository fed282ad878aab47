"""Tiny random Hugging Face causal LMs of many architectures, built from configs (no downloads).

Each entry is a small config of one model family, sized so that a forward takes milliseconds: two
layers, hidden size 64, a 259-token vocabulary (the embedded tokenizer's: 256 bytes and three
specials). Weights come from a fixed seed, so two builds of one architecture are equal. Used to
check that what asyncpp computes matches plain Hugging Face runs on every family.
"""

from __future__ import annotations

from pathlib import Path
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
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.25, "use_parallel_residual": True}),
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


def tiny_config(arch: str, checkpoint: bool = False) -> Any:
    """The config of the tiny model of family ``arch`` (a key of :data:`ARCHITECTURES`); with
    ``checkpoint``, at the sizes of :func:`tiny_checkpoint`."""
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
    if arch == "gpt_neox":  # (multi-head attention only: vLLM would size its KV cache by this)
        values.pop("num_key_value_heads")
    values.update(overrides)
    if checkpoint:
        values.update(_checkpoint_overrides(arch))
    return getattr(transformers, config_cls)(**values)


# what vLLM's CPU kernels need on top (head size 32, MoE hidden sizes a multiple of 32): the sizes
# of the checkpoints :func:`tiny_checkpoint` saves for vLLM
CHECKPOINT_SIZES: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
}


def _checkpoint_overrides(arch: str) -> dict[str, Any]:
    if arch == "gpt2":
        return {"n_embd": 128, "n_inner": 256, "n_positions": 512}
    overrides = dict(CHECKPOINT_SIZES)
    if "head_dim" in ARCHITECTURES[arch][2]:
        overrides["head_dim"] = 32
    if arch.startswith("gemma"):  # vLLM's Gemma models always tie the head to the embeddings
        overrides["tie_word_embeddings"] = True
    return overrides


def build_tiny(arch: str, seed: int = 0, checkpoint: bool = False) -> Any:
    """A tiny random model of family ``arch``, in eval mode, float32, from a fixed seed. With
    ``checkpoint``, at the sizes of :func:`tiny_checkpoint` (the very model that folder holds)."""
    import torch
    import transformers

    config = tiny_config(arch, checkpoint)
    model_cls = getattr(transformers, ARCHITECTURES[arch][1])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float().eval()


def tiny_checkpoint(arch: str, seed: int = 0) -> Path:
    """A folder holding the tiny model of family ``arch`` at vLLM's sizes (see
    :data:`CHECKPOINT_SIZES`) and the embedded byte-level tokenizer, saved with
    ``save_pretrained`` (float32) under asyncpp's cache and built there on first use: what a
    ``VllmEngine`` loads (``asyncpp.VllmEngine(tiny_checkpoint("qwen2"), dtype="float32")``)."""
    from .tiny import cached_folder

    def build(path: Path) -> None:
        from transformers.utils import logging as hf_logging

        from .tiny import _tokenizer

        hf_logging.disable_progress_bar()
        build_tiny(arch, seed, checkpoint=True).save_pretrained(path)
        _tokenizer().save_pretrained(path)

    tiny_config(arch)  # (an unknown family fails here, with the known ones)
    return cached_folder(
        f"tiny-{arch}", [arch, seed, _checkpoint_overrides(arch), ARCHITECTURES[arch]], build
    )
