"""Steering generation: edit the residual stream at every generated token with ``m.steps()``.

``async for step in m.steps()`` runs its body once per generation step (step 0 is the prompt's
forward); every un-pinned await inside the body refers to that step. The loop ends when generation
ends, and code after it still runs. On each generated step ``m.std.layers[i].resid_out`` is
``[rows, 1, hidden]``: the newest position only (the prompt's forward has all of them).

    .venv/bin/python examples/generation_steering.py
"""

import asyncio

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "The weather today is"
LAYER = 2


def show(tok, ids):
    """Byte-level tokens as the tokenizer's printable symbols (one symbol per token)."""
    return "".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


async def steer_every_step(m, vec):
    steps = 0
    async for _step in m.steps():
        out = await m.std.layers[LAYER].resid_out
        out[:, -1] += vec  # the newest position of this step
        steps += 1
    return steps


async def steer_some_steps(m, vec, select):
    async for _step in m.steps(select):  # a list or range of step numbers
        out = await m.std.layers[LAYER].resid_out
        out[:, -1] += vec


async def plain(m):
    # an empty step loop just counts the steps
    return sum([1 async for _ in m.steps()])


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)
    target = tok.encode("!", add_special_tokens=False)[0]
    direction = model.get_output_embeddings().weight[target].detach()  # the unembedding row
    vec = 8.0 * direction / direction.norm()

    # three invokes of one prompt, generated together as one batch
    async with asyncpp.generate(engine, max_new_tokens=10) as t:
        base = t.invoke(PROMPT, plain)
        every = t.invoke(PROMPT, steer_every_step, vec)
        later = t.invoke(PROMPT, steer_some_steps, vec, range(5, 10))

    print(f"prompt: {PROMPT!r}, 10 new tokens, steering towards '!' at std.layers[{LAYER}].resid_out")
    print(f"  no steering       {show(tok, base.tokens[0])!r}  ({base.result} steps)")
    print(f"  every step        {show(tok, every.tokens[0])!r}  ({every.result} steps)")
    print(f"  steps 5 to 9 only {show(tok, later.tokens[0])!r}")
    same_start = base.tokens[0, :5].tolist() == later.tokens[0, :5].tolist()
    print(f"  the first 5 tokens are untouched when steering starts at step 5: {same_start}")


if __name__ == "__main__":
    asyncio.run(main())
