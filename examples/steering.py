"""Steering: add a vector to the residual stream after one layer, at the last position, and see the
logits move.

The vector points along the unembedding row of a target token, so the target's probability rises.
Three invokes of the same prompt share one batched forward; the edit lands only in the steered rows.
The blocks use the standard view (``m.std``), so they run unchanged on a vLLM engine.

    .venv/bin/python examples/steering.py
"""

import asyncio

import torch

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "The cat sat on the"
LAYER = 2


def show(tok, ids):
    """Byte-level tokens as the tokenizer's printable symbols (one symbol per token)."""
    return "".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


async def last_logits(m):
    return (await m.std.logits)[:, -1]


async def steer(m, vec):
    out = await m.std.layers[LAYER].resid_out  # [rows, seq, hidden], a view of the model's stream
    out[:, -1] += vec  # an in-place edit of the awaited tensor lands in the running model
    return (await m.std.logits)[:, -1]


async def steer_with_set(m, vec):
    # the same edit as a replacement: `await loc.set(value)` swaps in a new value
    last = await m.std.layers[LAYER].resid_out[:, -1]
    await m.std.layers[LAYER].resid_out[:, -1].set(last + vec)
    return (await m.std.logits)[:, -1]


def top(tok, logits, k=5):
    p = logits.softmax(-1)
    values, ids = p.topk(k)
    return "  ".join(f"{show(tok, [i])!r} {float(v):.2f}" for v, i in zip(values, ids))


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)
    target = tok.encode("!", add_special_tokens=False)[0]
    direction = model.get_output_embeddings().weight[target].detach()  # the unembedding row
    vec = 8.0 * direction / direction.norm()

    async with asyncpp.trace(engine) as t:
        plain = t.invoke(PROMPT, last_logits)
        steered = t.invoke(PROMPT, steer, vec)
        by_set = t.invoke(PROMPT, steer_with_set, vec)

    before, after = plain.result[0], steered.result[0]
    print(f"prompt: {PROMPT!r}; adding 8 x unit(W_U['!']) to std.layers[{LAYER}].resid_out, last position")
    print(f"  top-5 before: {top(tok, before)}")
    print(f"  top-5 after:  {top(tok, after)}")
    p0, p1 = before.softmax(-1)[target], after.softmax(-1)[target]
    print(f"  p('!') {p0:.3f} -> {p1:.3f}; max |logit change| {(after - before).abs().max():.3f}")
    print(f"  in-place edit and .set() agree: {torch.allclose(after, by_set.result[0])}")


if __name__ == "__main__":
    asyncio.run(main())
