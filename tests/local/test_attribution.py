"""examples/attribution_patching.py checked against the same computations in plain PyTorch."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "attribution_patching.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("attribution_patching", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ids(tok, text):
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def tokens(tok):
    return tok(" mat", add_special_tokens=False)["input_ids"][0], tok("z")["input_ids"][0]


def test_attribution_patching_equals_plain_pytorch(tiny, engine, example):
    model, tok = tiny
    good, bad = tokens(tok)
    scores = asyncio.run(example.attribution_patching(engine, example.CLEAN, example.CORRUPT, good, bad))

    def run(text, grad):
        outs = {}
        handles = [
            layer.register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(i, o))
            for i, layer in enumerate(model.model.layers)
        ]
        try:
            with torch.set_grad_enabled(grad):
                logits = model(ids(tok, text)).logits
        finally:
            for h in handles:
                h.remove()
        return logits, [outs[i] for i in range(len(outs))]

    _, clean = run(example.CLEAN, False)
    logits, corrupt = run(example.CORRUPT, True)
    metric = logits[0, -1, good] - logits[0, -1, bad]
    grads = torch.autograd.grad(metric, corrupt)
    ref = torch.stack([((c - x.detach()) * g).sum(-1)[0] for c, x, g in zip(clean, corrupt, grads)])
    torch.testing.assert_close(scores, ref, rtol=1e-4, atol=1e-6)
    assert ref.abs().max() > 1e-4  # the prompts differ, so the estimates do too


def test_integrated_gradients_equal_plain_pytorch_and_are_complete(tiny, engine, example):
    model, tok = tiny
    good, bad = tokens(tok)
    emb = model.model.embed_tokens
    with torch.no_grad():
        x, base = emb(ids(tok, example.CLEAN)), emb(ids(tok, example.CORRUPT))
    steps = 4
    ig, ends = asyncio.run(example.integrated_gradients(engine, example.CLEAN, base, good, bad, steps=steps))

    grads = []
    for k in range(steps):
        point = (base + (k + 0.5) / steps * (x - base)).requires_grad_(True)
        logits = model(inputs_embeds=point).logits
        (g,) = torch.autograd.grad(logits[0, -1, good] - logits[0, -1, bad], point)
        grads.append(g)
    ref = ((x - base) * torch.stack(grads).mean(0)).sum(-1)[0]
    torch.testing.assert_close(ig, ref, rtol=1e-4, atol=1e-6)
    assert ref.abs().max() > 1e-4
    # with more points the attributions add up to the metric's change along the path
    ig32, ends = asyncio.run(example.integrated_gradients(engine, example.CLEAN, base, good, bad, steps=32))
    torch.testing.assert_close(ig32.sum(), ends[1] - ends[0], rtol=0.02, atol=1e-4)
