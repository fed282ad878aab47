"""Logit lens: decode every layer's residual stream, at every position, as the model decodes its last.

``m.std.unembed(h)`` is the model's own decoding (its final norm, its head, and any final transform
such as Gemma-2's soft-capping), called plainly on a value the block holds: not a visit of those
modules, so it is not counted as one of their calls, served to a block or edited by one, and the
model's own logits (``m.std.logits``) are untouched by it. The same block runs on a vLLM engine.
The last layer through the lens is exactly the model's logits.

Prints, for each position of the prompt, each layer's top token and its probability, and saves a
heat map of those probabilities (layers x positions, annotated with the top tokens) as a PNG:
``examples/out/logit_lens.png``, or the path given with ``--out`` (needs matplotlib:
``pip install 'asyncpp[plot]'``; without it, the table only).

    .venv/bin/python examples/logit_lens.py [--out PATH]
"""

import argparse
import asyncio
from pathlib import Path

import torch

import asyncpp
from asyncpp.models import load_tiny

PROMPT = "The quick brown fox"
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "logit_lens.png"


def show(tok, ids):
    """Byte-level tokens as the tokenizer's printable symbols (one symbol per token)."""
    return "".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


async def logit_lens(m):
    lens = []
    for layer in m.std.layers:  # iterates like a layer list
        h = await layer.resid_out  # [rows, seq, hidden]: the stream after this layer
        lens.append(m.std.unembed(h))  # [rows, seq, vocab], computed now (h is valid until the next await)
    logits = await m.std.logits  # the model's own logits, still the run's
    return torch.stack(lens, dim=1), logits.clone()  # (rows, layers, seq, vocab), (rows, seq, vocab)


def plot(probs, top_tokens, inputs, path):
    """A heat map of the top token's probability per layer and position, annotated with the token."""
    try:
        import matplotlib
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'asyncpp[plot]' to get it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, positions = probs.shape
    fig, ax = plt.subplots(figsize=(0.55 * positions + 2, 0.6 * layers + 1.6))
    image = ax.imshow(probs, cmap="viridis", aspect="auto")
    middle = (probs.min() + probs.max()) / 2
    for layer in range(layers):
        for pos in range(positions):
            light = probs[layer, pos] < middle
            ax.text(pos, layer, top_tokens[layer][pos], ha="center", va="center", fontsize=8,
                    color="white" if light else "black")  # fmt: skip
    ax.set_xticks(range(positions), inputs, fontsize=8)
    ax.set_yticks(range(layers), [f"layer {i}" for i in range(layers)])
    ax.set_xlabel("input token (the lens predicts the next one)")
    ax.set_title(f"logit lens: top token and its probability, {PROMPT!r}")
    fig.colorbar(image, ax=ax, label="p(top token)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved the heat map to {path}")


async def main(out):
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)

    async with asyncpp.trace(engine) as t:  # the forward runs on the engine's model thread
        h = t.invoke(PROMPT, logit_lens)
    lens, final_logits = h.result
    probs, top = lens[0].softmax(-1).max(-1)  # (layers, seq): the top token's probability and id
    inputs = [show(tok, [i]) for i in tok(PROMPT, add_special_tokens=False)["input_ids"]]
    tops = [[show(tok, [i]) for i in row] for row in top]

    print(f"prompt: {PROMPT!r}; per position, each layer's top next token and its probability")
    print("pos  input  " + "  ".join(f"layer {i:<5}" for i in range(len(tops))))
    for pos, token in enumerate(inputs):
        cells = "  ".join(f"{tops[layer][pos]!r:5} {probs[layer, pos]:.3f}" for layer in range(len(tops)))
        print(f"{pos:3}  {token!r:5}  {cells}")

    same = torch.allclose(lens[0, -1], final_logits[0], atol=1e-5)
    print(f"last layer through the lens equals the model's logits: {same}")
    plot(probs.numpy(), tops, inputs, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the PNG to write (default: {DEFAULT_OUT})"
    )
    asyncio.run(main(parser.parse_args().out))
