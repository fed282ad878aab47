"""A per-token logit lens, streamed while the model generates.

At every generation step the block decodes each layer's last-position hidden state with the final
norm and lm_head (the logit lens) and hands the result to the caller with ``asyncpp.emit``. The
caller iterates ``handle.stream()`` inside ``async with`` and prints each step as soon as the model
has made it, while generation goes on on the engine's model thread; the event loop stays free.

    .venv/bin/python examples/streaming_logit_lens.py
"""

import asyncio
import time

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "The quick brown fox"


async def streaming_lens(m, model):
    async for step in m.steps():
        tops = []
        for layer in m.model.layers:
            h = (await layer.output)[:, -1]
            tops.append(int(model.lm_head(model.model.norm(h)).argmax(-1)))  # the model's modules
        token = int((await m.logits)[0, -1].argmax())
        asyncpp.emit({"step": step, "lens": tops, "token": token})  # to the caller, now


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)
    show = tok.convert_ids_to_tokens
    print(f"prompt: {PROMPT!r}; top token per layer at each step, as the steps are made")
    start = time.perf_counter()
    async with asyncpp.generate(engine, max_new_tokens=8) as t:
        h = t.invoke(PROMPT, streaming_lens, model)
        async for item in h.stream():  # starts the run; yields while it goes on
            ms = (time.perf_counter() - start) * 1e3
            lens = " ".join(f"{s!r:6}" for s in show(item["lens"]))
            print(f"  step {item['step']}  {ms:6.1f} ms  layers: {lens} -> {show([item['token']])[0]!r}")
    print(f"generated: {tok.decode(h.tokens[0])!r}")


if __name__ == "__main__":
    asyncio.run(main())
