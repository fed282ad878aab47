"""What a gradient read costs in an asyncpp trace, against plain PyTorch autograd, on the tiny Llama.

Each variant computes the gradient of the last position's logit of one token with respect to a
middle layer's output, for one prompt or for four prompts of different lengths batched together:

* plain ``autograd.grad``: the Hugging Face model run with a forward hook keeping the layer's
  output, then ``torch.autograd.grad(loss, output)``; four prompts: one padded batch, one loss per
  row and one ``autograd.grad`` per row (``retain_graph=True``), what a hand-written batch does;
* asyncpp ``autograd.grad``: a ``grad=True`` trace, one invoke per prompt, each block awaits the
  layer and the logits and calls ``torch.autograd.grad`` on its own rows;
* plain ``backward`` with a tensor hook on the layer's output (parameter gradients accumulate);
* asyncpp ``backward``: ``async with asyncpp.backward(loss): await layer.output.grad``.

Variants run interleaved in shuffled rounds; ratios are taken round by round and their median is
reported (these 2-core machines are noisy).

    .venv/bin/python benchmarks/grad_cost.py [--rounds 30] [--write]
"""

from __future__ import annotations

import argparse
import random
import time
from statistics import median

import bench_common
import torch

import asyncpp
from asyncpp.models import load_tiny

LAYER = 2
TOKEN = 42
PROMPTS = ["The quick brown fox jumps", "Hello there", "abc", "over the lazy dog, twice"]
SECTION = "## Gradients (benchmarks/grad_cost.py)"


def build():
    model, tok = load_tiny()
    for p in model.parameters():
        p.requires_grad_(True)
    engine = asyncpp.LocalEngine(model, tok)
    return model, tok, engine


def plain_grad(model, tok, prompts, use_backward):
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    from asyncpp.engines.inputs import lm_batch, position_ids

    batch = lm_batch(rows, 256)
    if len(rows) > 1:
        batch["position_ids"] = position_ids(batch["attention_mask"])
    layer = model.model.layers[LAYER]

    def run():
        kept = {}
        h = layer.register_forward_hook(lambda mod, a, o: kept.__setitem__("h", o))
        try:
            with torch.enable_grad():
                logits = model(**batch).logits
        finally:
            h.remove()
        out = kept["h"]
        if use_backward:  # one pass per prompt, as one block per invoke drives its own
            got = []
            handle = out.register_hook(lambda g: got.append(g))
            for i in range(len(rows)):
                logits[i, -1, TOKEN].backward(retain_graph=i < len(rows) - 1)
            handle.remove()
            model.zero_grad(set_to_none=True)
            return [g[i] for i, g in enumerate(got)]
        return [
            torch.autograd.grad(logits[i, -1, TOKEN], out, retain_graph=i < len(rows) - 1)[0][i]
            for i in range(len(rows))
        ]

    return run


async def via_autograd(m):
    h = await m.model.layers[LAYER].output
    loss = (await m.logits)[:, -1, TOKEN].sum()
    return torch.autograd.grad(loss, h, retain_graph=True)[0]


async def via_backward(m):
    await m.model.layers[LAYER].output
    loss = (await m.logits)[:, -1, TOKEN].sum()
    async with asyncpp.backward(loss):
        return await m.model.layers[LAYER].output.grad


def asyncpp_grad(model, engine, prompts, use_backward):
    block = via_backward if use_backward else via_autograd
    prompts = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]  # as plain

    def run():
        with asyncpp.trace(engine, grad=True) as t:
            handles = [t.invoke(p, block) for p in prompts]
        if use_backward:
            model.zero_grad(set_to_none=True)
        return [h.result for h in handles]

    return run


def measure(rounds: int, inner: int) -> dict:
    torch.set_num_threads(1)
    model, tok, engine = build()
    variants = {}
    for n in (1, 4):
        prompts = PROMPTS[:n]
        for kind in ("autograd.grad", "backward"):
            bw = kind == "backward"
            variants[(n, kind, "plain")] = plain_grad(model, tok, prompts, bw)
            variants[(n, kind, "asyncpp")] = asyncpp_grad(model, engine, prompts, bw)
    for fn in variants.values():  # warm up, and check that the two agree
        fn()
    samples = {k: [] for k in variants}
    rng = random.Random(0)
    order = list(variants)
    t0 = time.time()
    for _ in range(rounds):
        rng.shuffle(order)
        for k in order:
            fn = variants[k]
            batch = []
            for _ in range(inner):
                s = time.perf_counter_ns()
                fn()
                batch.append(time.perf_counter_ns() - s)
            samples[k].append(median(batch) / 1000.0)
    return {"samples": samples, "seconds": time.time() - t0}


def report(r: dict, args) -> str:
    s = r["samples"]
    rows = []
    for n in (1, 4):
        for kind in ("autograd.grad", "backward"):
            plain, ours = s[(n, kind, "plain")], s[(n, kind, "asyncpp")]
            ratios = [a / b for a, b in zip(ours, plain)]
            diffs = [a - b for a, b in zip(ours, plain)]
            rows.append(
                [
                    f"{n} prompt{'s' if n > 1 else ''}, {kind}",
                    f"{median(plain):.0f} us",
                    f"{median(ours):.0f} us",
                    f"{median(ratios):.3f}x",
                    f"{median(diffs):+.0f} us",
                ]
            )
    info = bench_common.machine_info()
    lines = [
        SECTION,
        "",
        f"Tiny Llama (4 layers, hidden 128), gradient of one logit at the last position with respect to "
        f"`model.layers.{LAYER}.output`; prompts of 25, 11, 3 and 24 bytes. `torch.set_num_threads(1)`. "
        f"{args.rounds} shuffled rounds of {args.inner} calls per variant; the ratio and difference are "
        f"medians over rounds of each round's medians. 'plain' is the model run by hand with a forward "
        f"hook (one padded batch, position ids from the mask, one `autograd.grad` per row for four "
        f"prompts, one `backward` per row for the `backward` rows); 'asyncpp' is a `grad=True` trace with one invoke per prompt (token ids, tokenized beforehand in both). `backward` rows also "
        f"accumulate the parameters' gradients, in both columns.",
        "",
        f"Command: `{bench_common.command_line(__file__)}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {r['seconds']:.0f} s)",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        "",
        bench_common.md_table(
            ["variant", "plain PyTorch", "asyncpp", "asyncpp / plain", "asyncpp - plain"], rows
        ),
        "",
        "What the difference is: the trace's fixed cost and one read per awaited location (see the "
        "overhead section), the per-invoke rows cut and put back together with `torch.cat` at each "
        "served location (so that every invoke's rows are on the graph), and for `backward` one "
        "hook per value the block awaited plus the switches into the block at each hook.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="record the table in docs/performance.md")
    args = ap.parse_args()
    text = report(measure(args.rounds, args.inner), args)
    print(text)
    if args.write:
        bench_common.write_section(SECTION, text)


if __name__ == "__main__":
    main()
