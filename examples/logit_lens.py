"""Logit lens: decode each layer's last-token hidden state with the model's final norm and lm_head.

The decoding happens inside the block: a block may call the model's own modules (here
``model.model.norm`` and ``model.lm_head``) on values it holds. Those calls run plainly and are not
part of the run: they are not counted as calls of the modules, not served to any block and not
edited, so the model's own ``lm_head`` call (``m.logits``) is untouched by them.

    .venv/bin/python examples/logit_lens.py
"""

import asyncio

import torch

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "The quick brown fox jumps over the"


def show(tok, ids):
    """Byte-level tokens as the tokenizer's printable symbols (one symbol per token)."""
    return "".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


async def logit_lens(m, model):
    states, lens = [], []
    for layer in m.model.layers:  # a node of the location tree iterates its children
        h = (await layer.output)[:, -1]
        states.append(h)
        lens.append(model.lm_head(model.model.norm(h)))  # the model's modules, called plainly
    logits = await m.logits  # the model's own lm_head call, still the run's
    # (rows, layers, vocab), (rows, layers, hidden), (rows, vocab)
    return torch.stack(lens, dim=1), torch.stack(states, dim=1), logits[:, -1]


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)

    async with asyncpp.trace(engine) as t:  # the forward runs on the engine's model thread
        h = t.invoke(PROMPT, logit_lens, model)
    lens, states, final_logits = h.result
    probs = lens[0].softmax(-1)  # (layers, vocab)

    print(f"prompt: {PROMPT!r}")
    print("layer  top token  p")
    for layer, p in enumerate(probs):
        top = int(p.argmax())
        print(f"  {layer}    {show(tok, [top])!r:9}  {p[top]:.3f}")

    same = torch.allclose(lens[0, -1], final_logits[0], atol=1e-5)
    print(f"last layer through the lens equals the model's logits: {same}")

    with torch.no_grad():  # after the trace the modules are plain modules anyway
        after = model.lm_head(model.model.norm(states))
    agree = torch.allclose(after, lens, atol=1e-6)
    print(f"the lens inside the block equals the lens after the trace: {agree}")


if __name__ == "__main__":
    asyncio.run(main())
