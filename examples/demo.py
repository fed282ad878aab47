"""A short tour of asyncpp on the embedded tiny Llama (random weights, so the tokens are noise;
the point is the mechanics). This is what ``make demo`` runs.

    .venv/bin/python examples/demo.py
"""

import asyncio
import time
import traceback

import torch

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "The cat sat on the"


def show(tok, ids):
    """Byte-level tokens as the tokenizer's printable symbols (one symbol per token)."""
    return "".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


# --- intervention blocks: `m` is the model's location tree; every await waits for the model -------


async def last_token_states(m):
    states = [(await layer.output)[:, -1] for layer in m.model.layers]
    return torch.stack(states, dim=1)  # (rows, layers, hidden)


async def steer(m, layer, vec):
    out = await m.model.layers[layer].output
    out[:, -1] += vec  # in place: lands in the running model, in this invoke's rows only
    return (await m.logits)[:, -1].softmax(-1)


async def next_token_probs(m):
    return (await m.logits)[:, -1].softmax(-1)


async def steer_generation(m, layer, vec):
    async for _step in m.steps():  # once per generated token; awaits inside refer to that step
        out = await m.model.layers[layer].output
        out[:, -1] += vec


async def plain_generation(m):
    pass  # blocks may do nothing: the invoke still gets its rows' tokens


async def wrong_order(m):
    await m.model.layers[3].output
    await m.model.layers[1].output  # already passed: OrderError at this line


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)
    bang = tok.encode("!", add_special_tokens=False)[0]
    vec = 8.0 * model.lm_head.weight[bang].detach() / model.lm_head.weight[bang].norm()

    print(f"1. read hidden states (sync `with`), prompt {PROMPT!r}")
    with asyncpp.trace(engine) as t:  # sync form: runs on this thread at the end of the block
        h = t.invoke(PROMPT, last_token_states)
    norms = h.result[0].norm(dim=-1)
    print("   last-token hidden-state norm per layer:", " ".join(f"{n:.2f}" for n in norms))

    print("2. logit lens (final norm + lm_head applied to each layer's last token)")
    with torch.no_grad():
        lens = model.lm_head(model.model.norm(h.result[0])).softmax(-1)
    print("   top token per layer:", "  ".join(f"{show(tok, [p.argmax()])!r} {p.max():.3f}" for p in lens))

    print("3. steering: add a vector towards '!' at layers.2, last position")
    async with asyncpp.trace(engine) as t:  # async form: the forward runs on the model's thread
        base = t.invoke(PROMPT, next_token_probs)
        steered = t.invoke(PROMPT, steer, 2, vec)  # batched with the invoke above
    p0, p1 = base.result[0], steered.result[0]
    print(
        f"   top token {show(tok, [p0.argmax()])!r} -> {show(tok, [p1.argmax()])!r}, "
        f"p('!') {p0[bang]:.3f} -> {p1[bang]:.3f}"
    )

    print("4. two async traces at once with asyncio.gather (the caller's loop stays free)")

    async def one_trace(prompt):
        async with asyncpp.trace(engine) as t:
            h = t.invoke(prompt, next_token_probs)
        return show(tok, [h.result[0].argmax()])

    ticks = 0

    async def heartbeat(stop):
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0)
            ticks += 1

    stop = asyncio.Event()
    beat = asyncio.create_task(heartbeat(stop))
    start = time.perf_counter()
    a, b = await asyncio.gather(one_trace("Hello there, " * 8), one_trace("Good night, " * 8))
    stop.set()
    await beat
    ms = (time.perf_counter() - start) * 1e3
    print(f"   next tokens {a!r} and {b!r} in {ms:.0f} ms; the loop ran {ticks} other steps meanwhile")

    print("5. steering every generated token with `async for step in m.steps()`")
    async with asyncpp.generate(engine, max_new_tokens=12) as t:
        plain = t.invoke(PROMPT, plain_generation)
        pushed = t.invoke(PROMPT, steer_generation, 2, vec)
    print(f"   without: {show(tok, plain.tokens[0])!r}")
    print(f"   with:    {show(tok, pushed.tokens[0])!r}")

    print("6. mistakes fail at the user's line, with a message")
    try:
        with asyncpp.trace(engine) as t:
            t.invoke(PROMPT, wrong_order)
    except asyncpp.OrderError as err:
        where = traceback.extract_tb(err.__traceback__)[-1]  # the block's own line
        print(f"   OrderError at {where.name}(), line {where.lineno}: {str(err).split('. Await')[0]}")


if __name__ == "__main__":
    asyncio.run(main())
