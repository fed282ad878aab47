"""Logit lens: decode each layer's last-token hidden state with the model's final norm and lm_head.

The block only collects the hidden states; the decoding happens after the trace. (Calling the
model's own modules, such as ``model.lm_head``, inside a block would count as calls of those modules
in the run, so a block should not do that: use plain tensor ops in a block, or work after the run.)

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


async def last_token_states(m):
    states = []
    for layer in m.model.layers:  # a node of the location tree iterates its children
        states.append((await layer.output)[:, -1])
    logits = await m.logits
    return torch.stack(states, dim=1), logits[:, -1]  # (rows, layers, hidden), (rows, vocab)


async def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)

    async with asyncpp.trace(engine) as t:  # the forward runs on the engine's model thread
        h = t.invoke(PROMPT, last_token_states)
    states, final_logits = h.result

    with torch.no_grad():  # the trace is over: the model's modules are plain modules again
        lens = model.lm_head(model.model.norm(states))[0]  # (layers, vocab)
    probs = lens.softmax(-1)

    print(f"prompt: {PROMPT!r}")
    print("layer  top token  p")
    for layer, p in enumerate(probs):
        top = int(p.argmax())
        print(f"  {layer}    {show(tok, [top])!r:9}  {p[top]:.3f}")
    same = torch.allclose(lens[-1], final_logits[0], atol=1e-5)
    print(f"last layer through the lens equals the model's logits: {same}")


if __name__ == "__main__":
    asyncio.run(main())
