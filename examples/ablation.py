"""Ablation: zero a layer's attention or MLP output in place, or remove a whole layer, and measure
the effect on the next-token logits.

The ablations are edits of standard points (``m.std``), in one batched forward: an in-place
``zero_()`` of ``m.std.layers[i].attn_out`` or ``.mlp_out`` changes only the invoke's own rows, and
``await point.set(value)`` replaces a value (``resid_out.set(resid_in)`` makes a layer the
identity). Prints the effect of each ablation per layer and saves a bar chart of it as a PNG:
``examples/out/ablation.png``, or the path given with ``--out`` (needs matplotlib:
``pip install 'asyncpp[plot]'``; without it, the table only).

Skipping a module (its output supplied, the module never run) is an operation of the raw module
tree: ``m.std.layers[i].module`` is layer ``i``'s node there, and ``await node.skip(value)`` takes
the value in the form the module returns. A skip changes the whole batch, so it needs an invoke
that sees the whole batch (a trace with one invoke, or an invoke without input).

    .venv/bin/python examples/ablation.py [--out PATH]
"""

import argparse
import asyncio
from pathlib import Path

import torch

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "Once upon a time"
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "ablation.png"
PARTS = ("attn_out", "mlp_out")


def show(tok, ids):
    """Byte-level tokens as the tokenizer's printable symbols (one symbol per token)."""
    return "".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


async def last_logits(m):
    return (await m.std.logits)[:, -1]


async def zero_part(m, layer, part):
    out = await getattr(m.std.layers[layer], part)  # attn_out or mlp_out: [rows, seq, hidden]
    out.zero_()  # in place: only this invoke's rows of the batch
    return (await m.std.logits)[:, -1]


async def set_zeros(m, layer):
    out = await m.std.layers[layer].mlp_out
    await m.std.layers[layer].mlp_out.set(torch.zeros_like(out))  # a replacement, not an edit
    return (await m.std.logits)[:, -1]


async def remove_layer(m, layer):
    x = (await m.std.layers[layer].resid_in).clone()  # kept past the next await: cloned
    await m.std.layers[layer].resid_out.set(x)  # the layer's output is its input
    return (await m.std.logits)[:, -1]


async def skip_layer(m, layer):
    x = await m.std.layers[layer].resid_in
    await m.std.layers[layer].module.skip(x)  # the decoder layer never runs (its output: x)
    return (await m.std.logits)[:, -1]


def plot(effects, path):
    """A bar chart: max |logit change| per layer, one bar per ablated part."""
    try:
        import matplotlib
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'asyncpp[plot]' to get it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = len(next(iter(effects.values())))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(effects)
    for k, (part, values) in enumerate(effects.items()):
        ax.bar([i + (k - (len(effects) - 1) / 2) * width for i in range(layers)], values, width, label=part)
    ax.set_xticks(range(layers), [f"layer {i}" for i in range(layers)])
    ax.set_ylabel("max |logit change|, last position")
    ax.set_title(f"zeroing one output: {PROMPT!r}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved the bar chart to {path}")


async def main(out):
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)
    layers = range(model.config.num_hidden_layers)

    # One batched forward: a clean invoke plus one invoke per layer and part that zeroes it.
    async with asyncpp.trace(engine) as t:
        clean = t.invoke(PROMPT, last_logits)
        zeroed = {part: [t.invoke(PROMPT, zero_part, i, part) for i in layers] for part in PARTS}
        by_set = t.invoke(PROMPT, set_zeros, 1)
        removed = t.invoke(PROMPT, remove_layer, 1)
    base = clean.result[0]
    effects = {part: [float((h.result[0] - base).abs().max()) for h in zeroed[part]] for part in PARTS}
    print(f"prompt: {PROMPT!r}; clean top token {show(tok, [base.argmax()])!r}")
    print("zeroing one output: max |logit change| at the last position, and the top token")
    print("layer  " + "  ".join(f"{part:14}" for part in PARTS))
    for i in layers:
        cells = "  ".join(
            f"{effects[p][i]:.4f} {show(tok, [zeroed[p][i].result[0].argmax()])!r:7}" for p in PARTS
        )
        print(f"  {i}    {cells}")
    same = torch.allclose(by_set.result, zeroed["mlp_out"][1].result, atol=1e-5)
    print(f"mlp_out.set(zeros) of layers[1] equals zeroing it in place: {same}")
    print(f"removing all of layers[1]: max |logit change| {(removed.result[0] - base).abs().max():.4f}")
    plot(effects, out)

    # Skipping needs the whole batch: one invoke per trace here.
    async with asyncpp.trace(engine) as t:
        skipped = t.invoke(PROMPT, skip_layer, 1)
    same = torch.allclose(skipped.result, removed.result, atol=1e-5)
    print(f"skipping layers[1] (it never runs) equals setting its resid_out to its resid_in: {same}")

    # A skip from an invoke that owns only some rows is refused with a WriteError.
    try:
        async with asyncpp.trace(engine) as t:
            t.invoke(PROMPT, last_logits)
            t.invoke(PROMPT, skip_layer, 1)
    except asyncpp.WriteError as err:
        print(f"skip from a partial invoke: WriteError: {str(err).split(':')[1].strip()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the PNG to write (default: {DEFAULT_OUT})"
    )
    asyncio.run(main(parser.parse_args().out))
