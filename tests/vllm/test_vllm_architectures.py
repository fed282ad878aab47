"""The standard view (``m.std``) on vLLM, one tiny checkpoint of each architecture: the same blocks,
unchanged, give Hugging Face's numbers (reads, in-place and replacing writes, generation steering).

One engine per cell (architecture, tensor- and pipeline-parallel sizes, mode), alive only for that
cell's tests (parametrized at module scope, so engines start one after another). The cells run
eager engines, and compiled ones (taps) where the compiled path differs by family: Gemma-2 and
GPT-2, whose standard view reads the stream at the first layer's arguments (an inputs tap), GPT-2
at PP=2 too, and a MoE. Every cell passes compiled as well (run so once); the rest stay eager
because each compiled cell adds a compile of its own checkpoint to CI.
"""

from __future__ import annotations

import pytest
import torch
from helpers import std_points
from transformers import AutoTokenizer

import asyncpp
from asyncpp.models import build_tiny, tiny_checkpoint

pytest.importorskip("vllm")

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "mixtral", "qwen2_moe"]
# families vLLM runs through its Transformers backend (Hugging Face modules on [1, tokens, ...]),
# and one it has a class of its own for, sent there with model_impl="transformers" (Gemma-2: the
# standard view must know the family from the checkpoint, as the root is vLLM's wrapper class)
BACKEND_ARCHS = ["phi", "gpt_neox", "gemma2+transformers"]
# (architecture, tensor-parallel size, pipeline-parallel size): every architecture at PP=1; TP=2 on
# a MoE with a shared expert (partial sums) and on Gemma-2 (its vocabulary-parallel embedding is also
# its head); PP=2 on Llama (its norm and head on the last stage only) and on families that build
# their embedding and final norm on every stage, and on the Transformers backend (its stages run the
# rotary embedding each, a tied embedding is built on the first and the last); TP=2 x PP=2 on
# Gemma-2 and Qwen2-MoE; TP=2 on the Transformers backend (vLLM's linears in Hugging Face modules)
# (and the mode: eager, and compiled where that path differs by family)
CELLS = (
    [(arch, 1, 1, "eager") for arch in ARCHS + BACKEND_ARCHS]
    + [("qwen2_moe", 2, 1, "eager"), ("gemma2", 2, 1, "eager")]
    + [("llama", 1, 2, "eager"), ("gpt2", 1, 2, "eager"), ("mixtral", 1, 2, "eager")]
    + [("gemma2", 2, 2, "eager"), ("qwen2_moe", 2, 2, "eager")]
    + [("gemma2", 1, 1, "compiled"), ("gpt2", 1, 2, "compiled"), ("qwen2_moe", 1, 1, "compiled")]
    + [("gpt_neox", 1, 1, "compiled")]
    + [("gpt_neox", 1, 2, "eager"), ("gemma2+transformers", 1, 2, "eager"), ("phi", 1, 2, "compiled")]
    + [("gpt_neox", 2, 1, "eager"), ("phi", 2, 1, "compiled")]
)
ATOL = 1e-4  # float32, vLLM's CPU kernels against Hugging Face's
PROMPT = "The quick brown fox"


@pytest.fixture(
    scope="module",
    params=CELLS,
    ids=[f"{a}-tp{tp}-pp{pp}" + ("-compiled" if mode == "compiled" else "") for a, tp, pp, mode in CELLS],
)
def pair(request):
    """(Hugging Face engine, vLLM engine) on the same tiny checkpoint of one architecture."""
    arch, tp, pp, mode = request.param
    arch, _, impl = arch.partition("+")
    path = tiny_checkpoint(arch)
    hf = asyncpp.LocalEngine(build_tiny(arch, checkpoint=True), AutoTokenizer.from_pretrained(path))
    vl = asyncpp.VllmEngine(
        path,
        dtype="float32",
        mode=mode,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **({"model_impl": impl} if impl else {}),
    )
    yield hf, vl
    vl.close()
    hf.close()


async def std_edits(m, vec):
    """An in-place steer of layer 0's output, then layer 1's MLP replaced by zeros."""
    (await m.std.layers[0].resid_out)[:, -1] += vec
    h = (await m.std.layers[1].resid_in)[:, -1].clone()  # the same stream, edited above
    await m.std.layers[1].mlp_out.set(torch.zeros_like(await m.std.layers[1].mlp_out))
    return h, (await m.std.logits)[:, -1].clone()


async def logit_lens(m):
    """Every layer's last position decoded by the model's head, and the model's own logits."""
    lens = [m.std.unembed((await layer.resid_out)[:, -1:]) for layer in m.std.layers]
    return torch.cat(lens, dim=1), (await m.std.logits)[:, -1:].clone()


def both(pair, *invokes):
    """Each invoke's result on the Hugging Face engine, then on vLLM."""
    out = []
    for eng in pair:
        with asyncpp.trace(eng) as t:
            handles = [t.invoke(PROMPT, *inv) for inv in invokes]
        out.append([h.result for h in handles])
    return out


@pytest.mark.timeout(240)
def test_every_point_reads_as_on_hf(pair):
    (a,), (b,) = both(pair, (std_points,))
    n = a["embed"].shape[1]
    assert a.keys() == b.keys() and a["embed"].shape == (1, n, 128)
    assert a["logits"].shape == (1, n, 259) and b["logits"].shape == (1, 1, 259)  # vLLM: last only
    for k in a:
        expected = a[k][:, -1:] if k == "logits" else a[k]
        assert b[k].shape == expected.shape, k
        torch.testing.assert_close(b[k], expected, rtol=0, atol=ATOL, msg=k)
    assert b["logits"][0, -1].argmax() == a["logits"][0, -1].argmax()
    torch.testing.assert_close(b["resid_in1"], b["resid_out0"], rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_writes_land_as_on_hf(pair):
    vec = torch.linspace(-2.0, 2.0, 128)
    (base, (h_hf, logits_hf)), (base_vl, (h_vl, logits_vl)) = both(pair, (std_points,), (std_edits, vec))
    torch.testing.assert_close(h_vl, h_hf, rtol=0, atol=ATOL)
    torch.testing.assert_close(h_vl, base_vl["resid_out0"][:, -1] + vec, rtol=0, atol=ATOL)
    torch.testing.assert_close(logits_vl, logits_hf, rtol=0, atol=ATOL)
    assert (logits_vl - base_vl["logits"][:, -1]).abs().max() > 0.05  # the edits changed the output


@pytest.mark.timeout(240)
def test_the_logit_lens_as_on_hf(pair):
    ((lens_hf, logits_hf),), ((lens, logits),) = both(pair, (logit_lens,))
    assert lens.shape == lens_hf.shape and lens.shape[0] == 1 and lens.shape[2] == 259
    torch.testing.assert_close(lens, lens_hf, rtol=0, atol=ATOL)
    torch.testing.assert_close(lens[:, -1:], logits, rtol=0, atol=ATOL)  # the last layer: the logits
    torch.testing.assert_close(lens_hf[:, -1:], logits_hf, rtol=0, atol=ATOL)
    assert (lens[0, 0] - lens[0, -1]).abs().max() > 0.01  # the layers decode differently


@pytest.mark.timeout(240)
def test_generation_steering_as_on_hf(pair):
    vec = torch.linspace(3.0, -3.0, 128) * 4

    async def steer(m):
        async for _ in m.steps():
            (await m.std.layers[1].resid_out)[:, -1] += vec

    tokens = []
    for eng in pair:
        with asyncpp.generate(eng, max_new_tokens=5) as t:
            plain = t.invoke(PROMPT, None)
            steered = t.invoke(PROMPT, steer)
        tokens.append((plain.tokens[0].tolist(), steered.tokens[0].tolist()))
    assert tokens[1] == tokens[0]
    assert tokens[1][0] != tokens[1][1]  # the steering changed the tokens
