"""A causal LM whose family has no standard view, on vLLM: the engine refuses it when it is made,
naming what the module tree lacks, and ``standard_view=False`` runs it on the raw tree."""

from __future__ import annotations

import pytest
import torch

import asyncpp

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def opt_checkpoint(tmp_path_factory):
    """A tiny random OPT (``model.decoder.layers``: no family of the standard view) with the
    embedded byte-level tokenizer."""
    from transformers import OPTConfig, OPTForCausalLM

    from asyncpp.models.tiny import _tokenizer

    path = tmp_path_factory.mktemp("tiny-opt")
    tok = _tokenizer()
    config = OPTConfig(
        vocab_size=len(tok),
        hidden_size=128,
        word_embed_proj_dim=128,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    OPTForCausalLM(config).float().save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.timeout(240)
def test_an_unsupported_family_fails_at_engine_creation(opt_checkpoint):
    with pytest.raises(asyncpp.StandardViewError) as err:
        asyncpp.VllmEngine(opt_checkpoint, dtype="float32", mode="eager")
    message = str(err.value)
    assert "OPTForCausalLM" in message and "model.layers" in message
    assert "standard_view=False" in message


@pytest.mark.timeout(240)
def test_standard_view_false_runs_it_on_the_raw_tree(opt_checkpoint):
    async def raw(m):
        return (await m.model.decoder.layers[1].output).clone()

    async def std(m):
        await m.std.embed

    with asyncpp.VllmEngine(opt_checkpoint, dtype="float32", mode="eager", standard_view=False) as eng:
        with asyncpp.trace(eng) as t:
            h = t.invoke("The quick brown fox", raw)
        assert isinstance(h.result, torch.Tensor) and h.result.shape[-1] == 128
        with pytest.raises(
            asyncpp.PathError,
            match=r"m\.std: OPTForCausalLM has no standard view(.|\n)*test_vllm_unsupported\.py:\d+",
        ):
            with asyncpp.trace(eng) as t:
                t.invoke("The quick brown fox", std)


@pytest.mark.timeout(240)
def test_a_compiled_engine_taps_its_layers_as_hugging_face_computes_them(opt_checkpoint):
    """OPT's layer list is held deeper (``model.decoder.layers``): the default taps still find it,
    so a compiled engine serves every layer's output."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(opt_checkpoint, dtype=torch.float32)
    seen = []
    for layer in hf.model.decoder.layers:
        layer.register_forward_hook(
            lambda mod, args, out: seen.append((out[0] if isinstance(out, tuple) else out)[0])
        )
    prompt = "The quick brown fox"
    with torch.no_grad():
        hf(torch.tensor([list(prompt.encode())]))

    async def layers(m):
        return [(await layer.output).clone() for layer in m.model.decoder.layers]

    with asyncpp.VllmEngine(opt_checkpoint, dtype="float32", mode="compiled", standard_view=False) as eng:
        assert {"model.decoder.layers.0", "model.decoder.layers.1", "model.decoder.final_layer_norm"} <= set(
            eng.taps
        )
        with asyncpp.trace(eng) as t:
            h = t.invoke(list(prompt.encode()), layers)
    assert len(h.result) == 2
    for ours, theirs in zip(h.result, seen):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
