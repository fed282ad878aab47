"""Read a model's hidden states while it runs, with the synchronous ``with asyncpp.trace(...)`` form.

Shows the standard view ``m.std``: awaiting the residual stream after each layer
(``m.std.layers[i].resid_out``), the points inside one layer (``resid_in``, ``attn_out``,
``mlp_out``) and how they add up, a sub-element ``point[k]``, ``asyncpp.gather`` (several points
in any order), and how a batch of prompts of different lengths is split into each invoke's own
rows.

    .venv/bin/python examples/read_hidden_states.py
"""

import torch

import asyncpp
from asyncpp.models import load_tiny


async def read_layers(m):
    """Every await parks the block until the model reaches that point, then returns its value."""
    shapes = {}
    for i in range(4):  # points must be awaited in the order the model runs them
        h = await m.std.layers[i].resid_out
        shapes[f"layers[{i}].resid_out"] = tuple(h.shape)
    return shapes


async def one_layer(m):
    layer = m.std.layers[2]
    x = (await layer.resid_in).clone()  # clone what you keep: a value is valid until the next await
    attn = (await layer.attn_out).clone()
    mlp = (await layer.mlp_out).clone()
    out = await layer.resid_out
    adds_up = torch.allclose(x + attn + mlp, out, atol=1e-5)  # a pre-norm layer adds both to the stream
    is_next_input = torch.equal(out.clone(), await m.std.layers[3].resid_in)
    last = await m.std.layers[3].resid_out[:, -1]  # a sub-element: the last position only
    return adds_up, is_next_input, tuple(last.shape)


async def any_order(m):
    # gather waits on several points at once, listed in any order
    deep, shallow = await asyncpp.gather(m.std.layers[3].resid_out, m.std.layers[0].resid_out)
    return deep.shape == shallow.shape


async def my_rows(m):
    h = await m.std.layers[0].resid_out
    return tuple(h.shape)


def main():
    model, tok = load_tiny()
    engine = asyncpp.LocalEngine(model, tok)

    # The sync form: the forward runs on this thread when the `with` block exits.
    with asyncpp.trace(engine) as t:
        layers = t.invoke("Hello, world", read_layers)
    print("residual stream shapes (rows, tokens, hidden):")
    for name, shape in layers.result.items():
        print(f"  {name:19} {shape}")

    with asyncpp.trace(engine) as t:
        h = t.invoke("Hello, world", one_layer)
        g = t.invoke("Hello, world", any_order)
    adds_up, is_next_input, last = h.result
    print(f"layers[2]: resid_in + attn_out + mlp_out == resid_out: {adds_up}")
    print(f"layers[2].resid_out is layers[3].resid_in: {is_next_input}")
    print(f"layers[3].resid_out[:, -1] shape: {last}")
    print(f"gather in any order works: {g.result}")

    # Several invokes batch into one forward (left padded to the longest prompt). Each block sees
    # only its own rows, cut to its own longest prompt; an invoke without input sees the whole batch.
    with asyncpp.trace(engine) as t:
        short = t.invoke("Hi", my_rows)
        two = t.invoke(["Good morning", "Bonjour"], my_rows)
        whole = t.invoke(my_rows)
    print("rows each block sees at layers[0].resid_out:")
    print(f"  'Hi'                         {short.result}")
    print(f"  ['Good morning', 'Bonjour']  {two.result}")
    print(f"  no input (whole batch)       {whole.result}")
    print(
        f"each handle's .output: logits {tuple(short.output.logits.shape)} and "
        f"{tuple(two.output.logits.shape)}; whole run: {tuple(t.output.logits.shape)}"
    )


if __name__ == "__main__":
    main()
