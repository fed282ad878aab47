"""Attribution patching and integrated gradients: gradients inside a batched trace.

Attribution patching estimates, for every layer at once, how much patching that layer's output
from a clean run into a corrupted one would move a metric, from one forward and one backward pass:
(clean activation - corrupted activation) . d metric / d corrupted activation. Here the metric is
the corrupted prompt's logit difference between two next tokens, and both prompts run in one
trace: the clean invoke hands its layer outputs to the corrupted one through slots, and the
corrupted invoke drives the backward pass and reads each layer's gradient as it arrives.

Integrated gradients attribute the metric to the input embeddings: the embedding output is
replaced by points on a straight path from a baseline (the corrupted prompt's embeddings) to the
clean ones, one invoke per point, all in one batched trace, and the gradients along the path are
averaged.

    .venv/bin/python examples/attribution_patching.py
"""

from __future__ import annotations

import asyncio

import torch

import asyncpp
from asyncpp.models import load_tiny

CLEAN = "The cat sat on the mat"
CORRUPT = "The dog sat on the mat"  # same length: the positions line up


def logit_diff(logits: torch.Tensor, good: int, bad: int) -> torch.Tensor:
    """The metric: how much more the model predicts ``good`` than ``bad`` next."""
    return logits[:, -1, good].sum() - logits[:, -1, bad].sum()


async def clean_run(m, slots):
    for layer, slot in zip(m.model.layers, slots):
        slot.set((await layer.output).detach().clone())


async def corrupted_run(m, slots, good, bad):
    acts = [await layer.output for layer in m.model.layers]
    metric = logit_diff(await m.logits, good, bad)
    clean = [await slot for slot in slots]
    scores = [None] * len(acts)
    async with asyncpp.backward(metric):
        for i in reversed(range(len(acts))):  # the backward reaches the last layer first
            grad = await m.model.layers[i].output.grad
            scores[i] = ((clean[i] - acts[i].detach()) * grad).sum(-1)  # per position
    return torch.stack(scores)  # (layers, 1, positions)


async def attribution_patching(engine, clean: str, corrupt: str, good: int, bad: int) -> torch.Tensor:
    """Per layer and position, the attribution-patching estimate of patching clean into corrupt."""
    slots = [asyncpp.Slot(f"clean layer {i}") for i in range(len(engine.tree.model.layers))]
    async with asyncpp.trace(engine, grad=True) as t:
        t.invoke(clean, clean_run, slots)
        h = t.invoke(corrupt, corrupted_run, slots, good, bad)
    return h.result[:, 0]


async def along_path(m, alpha, baseline, good, bad):
    emb = (await m.model.embed_tokens.output).detach()
    point = (baseline + alpha * (emb - baseline)).requires_grad_(True)
    await m.model.embed_tokens.output.set(point)
    metric = logit_diff(await m.logits, good, bad)
    (grad,) = torch.autograd.grad(metric, point, retain_graph=True)
    return grad, emb, metric


async def integrated_gradients(
    engine, prompt: str, baseline: torch.Tensor, good: int, bad: int, steps: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integrated gradients of the metric with respect to the input embeddings, per position, on
    the straight path from ``baseline`` (embeddings of the same shape) to the prompt's, with
    ``steps`` midpoint-rule points, all in one batched trace. Also returns the metric along the
    path's two ends (for the completeness check: the attributions sum to their difference)."""
    alphas = [(k + 0.5) / steps for k in range(steps)] + [0.0, 1.0]
    async with asyncpp.trace(engine, grad=True) as t:
        handles = [t.invoke(prompt, along_path, a, baseline, good, bad) for a in alphas]
    grads = torch.stack([h.result[0] for h in handles[:steps]]).mean(0)
    emb = handles[0].result[1]
    ends = torch.stack([handles[-2].result[2], handles[-1].result[2]])
    return ((emb - baseline) * grads).sum(-1)[0], ends


async def embeddings(m):
    return await m.model.embed_tokens.output


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)
    good, bad = tok(" mat", add_special_tokens=False)["input_ids"][0], tok("z")["input_ids"][0]

    scores = await attribution_patching(engine, CLEAN, CORRUPT, good, bad)
    print(f"attribution patching {CLEAN!r} -> {CORRUPT!r}, metric logit[{good}] - logit[{bad}]")
    print("layer  estimated effect of patching (summed over positions)")
    for i, s in enumerate(scores):
        print(f"  {i}    {s.sum():+.5f}")

    async with asyncpp.trace(engine) as t:
        base = t.invoke(CORRUPT, embeddings)
    ig, ends = await integrated_gradients(engine, CLEAN, base.result, good, bad, steps=32)
    print(f"integrated gradients from {CORRUPT!r} to {CLEAN!r}: per-position attributions")
    print("  " + " ".join(f"{v:+.4f}" for v in ig.tolist()))
    print(f"  sum {ig.sum():+.5f} vs metric(clean) - metric(corrupt) {ends[1] - ends[0]:+.5f} (completeness)")


if __name__ == "__main__":
    asyncio.run(main())
