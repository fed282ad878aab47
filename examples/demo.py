"""A short tour of asyncpp on the embedded tiny Llama (random weights, so the tokens are noise;
the point is the mechanics). This is what ``make demo`` runs.

    .venv/bin/python examples/demo.py                  # the local engine (default)
    .venv/bin/python examples/demo.py --engine vllm    # the same tour on a vLLM engine (auto mode)
    .venv/bin/python examples/demo.py --engine vllm --mode eager   # vLLM module by module

The blocks are written once for both engines, on the standard view ``m.std`` (see
docs/concepts.md): the residual stream of each layer and the logits mean the same thing, with the
same shapes, on every engine.
"""

import argparse
import asyncio
import re
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
    states = [(await layer.resid_out)[:, -1].clone() for layer in m.std.layers]  # clone: kept
    return torch.stack(states, dim=1)  # (rows, layers, hidden)


async def logit_lens(m):
    """Each layer's last-token stream decoded as the model decodes its last layer."""
    lens = [m.std.unembed((await layer.resid_out)[:, -1]) for layer in m.std.layers]
    return torch.stack(lens, dim=1).softmax(-1)  # (rows, layers, vocab)


async def steer(m, layer, vec):
    (await m.std.layers[layer].resid_out)[:, -1] += vec  # only this invoke's rows are edited
    return (await m.std.logits)[:, -1].softmax(-1)


async def next_token_probs(m):
    return (await m.std.logits)[:, -1].softmax(-1)


async def steer_generation(m, layer, vec):
    async for _step in m.steps():  # once per generated token; awaits inside refer to that step
        (await m.std.layers[layer].resid_out)[:, -1] += vec


async def plain_generation(m):
    pass  # blocks may do nothing: the invoke still gets its tokens


async def wrong_order(m):
    await m.std.layers[3].resid_out
    await m.std.layers[1].resid_out  # already passed: OrderError at this line


def block_frame(err, block):
    """Where ``block`` raised ``err``: (function, line). A local run raises with the block's own
    traceback; from vLLM the worker's traceback comes back as a note on the error."""
    here = block.__code__.co_filename
    for note in getattr(err, "__notes__", ()):
        frames = [
            (n, int(ln)) for f, ln, n in re.findall(r'File "(.+?)", line (\d+), in (\S+)', note) if f == here
        ]
        if frames:
            return frames[-1]
    frame = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == here][-1]
    return frame.name, frame.lineno


def make_engine(kind, model, tok, mode=None):
    if kind == "local":
        return asyncpp.LocalEngine(model, tok)
    # float32 like the local model: same numbers; the engine prints one progress line as it starts
    # (vllm_logs=True, or ASYNCPP_VLLM_LOGS=1, shows vLLM's own)
    engine = asyncpp.VllmEngine(dtype="float32", mode=mode)
    print(flush=True)
    return engine


async def main(kind, mode=None):
    model, tok = load_tiny()  # on vLLM: the logit lens and the steering vector use its weights
    engine = make_engine(kind, model, tok, mode)
    try:
        await tour(engine, model, tok, kind)
    finally:
        engine.close()


async def tour(engine, model, tok, kind):
    bang = tok.encode("!", add_special_tokens=False)[0]
    vec = 8.0 * model.lm_head.weight[bang].detach() / model.lm_head.weight[bang].norm()

    print(f"1. read hidden states (sync `with`), prompt {PROMPT!r}")
    with asyncpp.trace(engine) as t:  # sync form: blocks the calling thread until the run is over
        h = t.invoke(PROMPT, last_token_states)
    norms = h.result[0].norm(dim=-1)
    print("   last-token hidden-state norm per layer:", " ".join(f"{n:.2f}" for n in norms))

    print("2. logit lens (m.std.unembed: the final norm and head on each layer's last token)")
    with asyncpp.trace(engine) as t:
        h = t.invoke(PROMPT, logit_lens)
    lens = h.result[0]
    print("   top token per layer:", "  ".join(f"{show(tok, [p.argmax()])!r} {p.max():.3f}" for p in lens))

    print("3. steering: add a vector towards '!' at layers.2, last position")
    async with asyncpp.trace(engine) as t:  # async form: the caller's event loop stays free
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
        name, line = block_frame(err, wrong_order)
        print(f"   OrderError at {name}(), line {line}: {str(err).split('. Await')[0]}")
        if kind == "vllm":
            print("   (the block ran in vLLM's worker process; its traceback came back as a note)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engine", choices=["local", "vllm"], default="local", help="where the model runs (default: local)"
    )
    parser.add_argument(
        "--mode",
        choices=["auto", "compiled", "eager"],
        default=None,
        help="the vLLM engine's mode (default: VllmEngine's, auto; see docs/vllm.md#modes)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.engine, args.mode))
