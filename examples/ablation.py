"""Ablation: zero an MLP's output in place, or skip a module altogether, and measure the effect.

``await m.model.layers[1].mlp.skip(value)`` supplies the module's output without running it. A skip
changes the whole batch, so it needs an invoke that sees the whole batch (a trace with one invoke,
or an invoke without input).

    .venv/bin/python examples/ablation.py
"""

import asyncio

import torch

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "Once upon a time"


def show(tok, ids):
    """Byte-level tokens as the tokenizer's printable symbols (one symbol per token)."""
    return "".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


async def last_logits(m):
    return (await m.logits)[:, -1]


async def zero_mlp(m, layer):
    out = await m.model.layers[layer].mlp.output
    out.zero_()  # in place: only this invoke's rows of the batch
    return (await m.logits)[:, -1]


async def skip_mlp(m, layer):
    x = await m.model.layers[layer].mlp.input
    await m.model.layers[layer].mlp.skip(torch.zeros_like(x))  # the MLP never runs
    return (await m.logits)[:, -1]


async def skip_layer(m, layer):
    x = await m.model.layers[layer].input
    await m.model.layers[layer].skip(x)  # the whole decoder layer becomes the identity
    return (await m.logits)[:, -1]


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)

    # One batched forward: a clean invoke plus one invoke per layer that zeroes that layer's MLP.
    async with asyncpp.trace(engine) as t:
        clean = t.invoke(PROMPT, last_logits)
        zeroed = [t.invoke(PROMPT, zero_mlp, layer) for layer in range(4)]
    base = clean.result[0]
    print(f"prompt: {PROMPT!r}; clean top token {show(tok, [base.argmax()])!r}")
    print("zeroing one MLP's output (max |logit change| at the last position):")
    for layer, h in enumerate(zeroed):
        delta = (h.result[0] - base).abs().max()
        print(f"  layers.{layer}.mlp  {delta:.4f}   top token {show(tok, [h.result[0].argmax()])!r}")

    # Skipping needs the whole batch: one invoke per trace here.
    async with asyncpp.trace(engine) as t:
        skipped = t.invoke(PROMPT, skip_mlp, 1)
    same = torch.allclose(skipped.result, zeroed[1].result, atol=1e-5)
    print(f"skip(zeros) of layers.1.mlp equals zeroing its output: {same}")

    async with asyncpp.trace(engine) as t:
        gone = t.invoke(PROMPT, skip_layer, 1)
    print(f"skipping all of layers.1: max |logit change| {(gone.result[0] - base).abs().max():.4f}")

    # A skip from an invoke that owns only some rows is refused with a WriteError.
    try:
        async with asyncpp.trace(engine) as t:
            t.invoke(PROMPT, last_logits)
            t.invoke(PROMPT, skip_mlp, 1)
    except asyncpp.WriteError as err:
        print(f"skip from a partial invoke: WriteError: {str(err).split(':')[1].strip()}")


if __name__ == "__main__":
    asyncio.run(main())
