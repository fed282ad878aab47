"""A per-token logit lens, streamed while the model generates.

At every generation step the block decodes the residual stream after each layer, at the last
position, as the model decodes its last layer (``m.std.unembed``: the logit lens) and hands the
result to the caller with ``asyncpp.emit``. The caller iterates ``handle.stream()`` inside
``async with`` and prints each step as soon as the model has made it, while generation goes on on
the engine's model thread; the event loop stays free. The block is written on the standard view
(``m.std``), so it runs unchanged on a vLLM engine.

    .venv/bin/python examples/streaming_logit_lens.py
"""

import asyncio
import time

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "The quick brown fox"


async def streaming_lens(m):
    async for step in m.steps():
        tops = []
        for layer in m.std.layers:
            h = (await layer.resid_out)[0, -1]  # [hidden]: this step's newest position
            tops.append(int(m.std.unembed(h).argmax(-1)))  # decoded as the model decodes its last layer
        token = int((await m.std.logits)[0, -1].argmax())
        asyncpp.emit({"step": step, "lens": tops, "token": token})  # to the caller, now


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)
    show = tok.convert_ids_to_tokens
    print(f"prompt: {PROMPT!r}; top token per layer at each step, as the steps are made")
    start = time.perf_counter()
    async with asyncpp.generate(engine, max_new_tokens=8) as t:
        h = t.invoke(PROMPT, streaming_lens)
        async for item in h.stream():  # starts the run; yields while it goes on
            ms = (time.perf_counter() - start) * 1e3
            lens = " ".join(f"{s!r:6}" for s in show(item["lens"]))
            print(f"  step {item['step']}  {ms:6.1f} ms  layers: {lens} -> {show([item['token']])[0]!r}")
    print(f"generated: {tok.decode(h.tokens[0])!r}")


if __name__ == "__main__":
    asyncio.run(main())
