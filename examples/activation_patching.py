"""Activation patching: copy the residual stream after a layer, at the last position, from a clean
run into a corrupted one, in one batched trace, handing the value between the two invokes with a
Slot. The patched point is ``m.std.layers[i].resid_out``, the same point on every engine.

Patching the final layer makes the corrupted prompt's last-position logits equal the clean ones;
patching an earlier layer recovers part of the difference (later layers still attend to the
corrupted tokens).

    .venv/bin/python examples/activation_patching.py
"""

import asyncio

import torch

import asyncpp
from asyncpp.models import load_tiny

CLEAN = "The cat sat on the mat"
CORRUPT = "The dog sat on the mat"  # same length: the positions line up


async def last_logits(m):
    return (await m.std.logits)[:, -1]


async def source(m, layer, slot):
    out = await m.std.layers[layer].resid_out
    slot.set(out[:, -1].clone())  # hand the clean value over (wakes the waiting block at once)
    return (await m.std.logits)[:, -1]


async def patched(m, layer, slot):
    out = await m.std.layers[layer].resid_out
    out[:, -1] = await slot  # parks until the clean invoke sets it, within this same visit
    return (await m.std.logits)[:, -1]


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)

    async with asyncpp.trace(engine) as t:
        clean = t.invoke(CLEAN, last_logits)
        corrupt = t.invoke(CORRUPT, last_logits)
    gap = (corrupt.result - clean.result).norm()
    print(f"clean {CLEAN!r} vs corrupted {CORRUPT!r}: |logit difference| {gap:.4f}")

    print("patch layer -> |patched - clean|   recovered")
    for layer in range(4):
        slot = asyncpp.Slot(f"std.layers[{layer}].resid_out")
        async with asyncpp.trace(engine) as t:
            src = t.invoke(CLEAN, source, layer, slot)
            dst = t.invoke(CORRUPT, patched, layer, slot)
        left = (dst.result - src.result).norm()
        print(f"  {layer}                 {left:.4f}            {1 - left / gap:6.1%}")
        if layer == 3:
            exact = torch.allclose(dst.result, src.result, atol=1e-6)
            print(f"final layer patched: logits equal the clean run's: {exact}")


if __name__ == "__main__":
    asyncio.run(main())
