"""Attribution patching and integrated gradients: gradients inside a batched trace.

Attribution patching estimates, for every layer at once, how much patching the residual stream
after that layer (``m.std.layers[i].resid_out``) from a clean run into a corrupted one would move a
metric, from one forward and one backward pass:
(clean activation - corrupted activation) . d metric / d corrupted activation. Here the metric is
the corrupted prompt's logit difference between two next tokens, and both prompts run in one
trace: the clean invoke hands its layer outputs to the corrupted one through slots, and the
corrupted invoke drives the backward pass and reads each layer's gradient as it arrives. The
gradient is read at the same standard point, ``m.std.layers[i].resid_out.grad``, cut to the
invoke's own tokens like the point's value.

Integrated gradients attribute the metric to the input embeddings: the embeddings
(``m.std.embed``) are replaced by points on a straight path from a baseline (the corrupted prompt's embeddings) to the
clean ones, one invoke per point, all in one batched trace, and the gradients along the path are
averaged; ``torch.autograd.grad`` takes the gradient with respect to the point the block set.

Prints both attributions and saves a picture of them as a PNG (attribution patching per layer and
position, integrated gradients per position): ``examples/out/attribution_patching.png``, or the
path given with ``--out`` (needs matplotlib: ``pip install 'asyncpp[plot]'``; without it, the
numbers only).

    .venv/bin/python examples/attribution_patching.py [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import torch

import asyncpp
from asyncpp.models import load_tiny

CLEAN = "The cat sat on the mat"
CORRUPT = "The dog sat on the mat"  # same length: the positions line up
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "attribution_patching.png"


def logit_diff(logits: torch.Tensor, good: int, bad: int) -> torch.Tensor:
    """The metric: how much more the model predicts ``good`` than ``bad`` next."""
    return logits[:, -1, good].sum() - logits[:, -1, bad].sum()


async def clean_run(m, slots):
    for layer, slot in zip(m.std.layers, slots):
        slot.set((await layer.resid_out).detach().clone())


async def corrupted_run(m, slots, good, bad):
    acts = [await layer.resid_out for layer in m.std.layers]
    metric = logit_diff(await m.std.logits, good, bad)
    clean = [await slot for slot in slots]
    scores = [None] * len(acts)
    async with asyncpp.backward(metric):
        for i in reversed(range(len(acts))):  # the backward reaches the last layer first
            grad = await m.std.layers[i].resid_out.grad
            scores[i] = ((clean[i] - acts[i].detach()) * grad).sum(-1)  # per position
    return torch.stack(scores)  # (layers, 1, positions)


async def attribution_patching(engine, clean: str, corrupt: str, good: int, bad: int) -> torch.Tensor:
    """Per layer and position, the attribution-patching estimate of patching clean into corrupt."""
    slots = [asyncpp.Slot(f"clean layer {i}") for i in range(len(engine.tree.std.layers))]
    async with asyncpp.trace(engine, grad=True) as t:
        t.invoke(clean, clean_run, slots)
        h = t.invoke(corrupt, corrupted_run, slots, good, bad)
    return h.result[:, 0]


async def along_path(m, alpha, baseline, good, bad):
    emb = (await m.std.embed).detach().clone()
    point = (baseline + alpha * (emb - baseline)).requires_grad_(True)
    await m.std.embed.set(point)
    metric = logit_diff(await m.std.logits, good, bad)
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
    return (await m.std.embed).clone()


def plot(scores, ig, tokens, path):
    """Attribution patching per layer and position (a heat map) over integrated gradients per
    position (bars), both against the prompt's tokens."""
    try:
        import matplotlib
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'asyncpp[plot]' to get it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, positions = scores.shape
    fig, ((top, bar), (bottom, blank)) = plt.subplots(
        2, 2, figsize=(0.45 * positions + 3, 6), gridspec_kw={"width_ratios": [40, 1]}
    )
    bound = float(abs(scores).max()) or 1.0
    image = top.imshow(scores, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    top.set_yticks(range(layers), [f"layer {i} ({float(s.sum()):+.3f})" for i, s in enumerate(scores)])
    top.set_xticks(range(positions), tokens, fontsize=8)
    top.set_title("attribution patching: estimated effect of patching resid_out (sum per layer)")
    fig.colorbar(image, cax=bar, label="effect on the metric")
    bottom.bar(range(positions), ig, color=["tab:red" if v > 0 else "tab:blue" for v in ig])
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_xlim(-0.5, positions - 0.5)  # the heat map's columns
    bottom.set_xticks(range(positions), tokens, fontsize=8)
    bottom.set_title("integrated gradients of the embeddings, per position")
    bottom.set_xlabel(f"{CLEAN!r} / {CORRUPT!r}, by token")
    blank.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved the picture to {path}")


async def main(out):
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

    clean, corrupt = (
        tok.convert_ids_to_tokens(tok(p, add_special_tokens=False)["input_ids"]) for p in (CLEAN, CORRUPT)
    )
    tokens = [a if a == b else f"{a}/{b}" for a, b in zip(clean, corrupt)]
    plot(scores.detach().numpy(), ig.detach().numpy(), tokens, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the PNG to write (default: {DEFAULT_OUT})"
    )
    asyncio.run(main(parser.parse_args().out))
