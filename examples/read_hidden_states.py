"""Read a model's hidden states while it runs, with the synchronous ``with asyncpp.trace(...)`` form.

Shows: awaiting a layer's output, a module's ``.input`` / ``.inputs``, a sub-element ``loc[k]``,
``asyncpp.gather`` (several locations in any order), and how a batch of prompts of different
lengths is split into each invoke's own rows.

    .venv/bin/python examples/read_hidden_states.py
"""

import torch

import asyncpp
from asyncpp.models import load_tiny


async def read_layers(m):
    """Every await parks the block until the model reaches that location, then returns its value."""
    shapes = {}
    for i in range(4):  # locations must be awaited in the order the model runs them
        h = await m.model.layers[i].output
        shapes[f"layers.{i}"] = tuple(h.shape)
    return shapes


async def input_and_inputs(m):
    out1 = await m.model.layers[1].output
    x2 = await m.model.layers[2].input  # the first positional argument of layer 2's call
    args, kwargs = await m.model.layers[2].inputs  # all of it: (args, kwargs)
    last = await m.model.layers[3].output[:, -1]  # a sub-element: the last position only
    return torch.equal(out1, x2), sorted(kwargs), tuple(last.shape)


async def any_order(m):
    # gather waits on several locations at once, listed in any order
    deep, shallow = await asyncpp.gather(m.model.layers[3].output, m.model.layers[0].output)
    return deep.shape == shallow.shape


async def my_rows(m):
    h = await m.model.layers[0].output
    return tuple(h.shape)


def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)

    # The sync form: the forward runs on this thread when the `with` block exits.
    with asyncpp.trace(engine) as t:
        layers = t.invoke("Hello, world", read_layers)
    print("layer output shapes (batch, tokens, hidden):")
    for name, shape in layers.result.items():
        print(f"  {name:9} {shape}")

    with asyncpp.trace(engine) as t:
        h = t.invoke("Hello, world", input_and_inputs)
        g = t.invoke("Hello, world", any_order)
    same, kw, last = h.result
    print(f"layers.1 output is layers.2 input: {same}")
    print(f"layers.2 keyword arguments: {kw}")
    print(f"layers.3.output[:, -1] shape: {last}")
    print(f"gather in any order works: {g.result}")

    # Several invokes batch into one forward (left padded to the longest prompt). Each block sees
    # only its own rows; an invoke without input sees the whole batch.
    with asyncpp.trace(engine) as t:
        short = t.invoke("Hi", my_rows)
        two = t.invoke(["Good morning", "Bonjour"], my_rows)
        whole = t.invoke(my_rows)
    print("rows each block sees at layers.0:")
    print(f"  'Hi'                         {short.result}")
    print(f"  ['Good morning', 'Bonjour']  {two.result}")
    print(f"  no input (whole batch)       {whole.result}")
    print(
        f"each handle's .output: logits {tuple(short.output.logits.shape)} and "
        f"{tuple(two.output.logits.shape)}; whole run: {tuple(t.output.logits.shape)}"
    )


if __name__ == "__main__":
    main()
