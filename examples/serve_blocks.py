"""Blocks an operator registers for `asyncpp serve`: clients name them and pass data only.

    .venv/bin/asyncpp serve --dtype float32 --blocks examples/serve_blocks.py

Each block declares its client parameters with types (`Tensor[dtype, max_shape]`, `Range`, ...):
the server checks a request's arguments against them before anything runs, and answers a mismatch
with 422. The blocks are written on the standard view `m.std` (docs/concepts.md), so they run on
any model `asyncpp serve` runs with one: `m.std.layers[i].resid_out` is the residual stream after
layer `i`, `[1, tokens, hidden]` for a request (`[0, -1]` is its last position), `m.std.logits` is
`[1, 1, vocab]` (vLLM computes the last position only), and `m.std.unembed(h)` decodes residual-
stream values as the model decodes its last layer (the logit lens; its final norm and head, on the
workers). Values a block keeps past its next await, or returns, are cloned: what it reads is a view
of the model's own tensors.

A client (any HTTP client; `asyncpp.serve.wire` encodes tensors):

    import httpx, torch
    from asyncpp.serve import wire

    body = wire.encode({"invokes": [{"prompt": "The cat sat", "block": "steer",
                                     "args": {"layer": 1, "vec": torch.randn(128), "scale": 4.0}}]})
    r = httpx.post("http://127.0.0.1:8000/v1/trace", content=body,
                   headers={"Content-Type": wire.CONTENT_TYPE, "Authorization": "Bearer <token>"})
    answer = wire.decode(r.content)   # {"model": ..., "invokes": [{"result", "error", "tokens", "text"}]}
"""

from __future__ import annotations

from typing import Annotated

import torch

from asyncpp.serve import Range, Registry, Tensor

blocks = Registry()

Layer = Annotated[int, Range(0, 1023)]


@blocks.block
async def steer(m, layer: Layer, vec: Tensor[torch.float32, (16384,)], scale: float = 1.0):
    """Add scale * vec to the residual stream after `layer`, at the last position, at every step; return step 0's next-token logits."""
    first = None
    async for _step in m.steps():
        stream = await m.std.layers[layer].resid_out
        if vec.shape[0] != stream.shape[-1]:
            raise ValueError(f"vec has {vec.shape[0]} entries, the model's hidden size is {stream.shape[-1]}")
        stream[0, -1] += scale * vec.to(stream.dtype)  # in place: the next layer reads the edited stream
        logits = await m.std.logits
        if first is None:
            first = logits[0, -1].float().clone()
    return first


@blocks.block
async def read_layer(m, layer: Layer):
    """The residual stream after `layer` at the prompt's last position (float32, [hidden])."""
    return (await m.std.layers[layer].resid_out)[0, -1].float().clone()


async def _lens_tops(m, k):
    """The logit lens at this step: each layer's last-position residual stream decoded as the
    model decodes its last layer (`m.std.unembed`), its top-k token ids ([layers][k]). Awaited
    from a block."""
    tops = []
    for layer in m.std.layers:
        h = (await layer.resid_out)[0, -1]
        tops.append(m.std.unembed(h).float().topk(k).indices.tolist())
    return tops


@blocks.block
async def logit_lens(m, k: Annotated[int, Range(1, 20)] = 1):
    """Each layer's last-position residual stream decoded with the final norm and the unembedding: the top-k token ids per layer ([layers][k]), and the model's own top-k."""
    tops = await _lens_tops(m, k)
    logits = await m.std.logits
    return {"lens": tops, "logits": logits[0, -1].float().topk(k).indices.tolist()}


@blocks.block
async def lens_stream(m, k: Annotated[int, Range(1, 20)] = 1):
    """A logit lens streamed at every generation step: emits {"step", "lens": the top-k token ids per layer at the last position, "logits": the model's own top-k} as each step is made; returns the number of steps."""
    import asyncpp

    n = 0
    async for _step in m.steps():
        tops = await _lens_tops(m, k)
        logits = await m.std.logits
        asyncpp.emit({"step": n, "lens": tops, "logits": logits[0, -1].float().topk(k).indices.tolist()})
        n += 1
    return n
