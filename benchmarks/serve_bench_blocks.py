"""The blocks benchmarks/serve_throughput.py registers with ``asyncpp serve``.

    .venv/bin/python -m asyncpp.serve --dtype float32 --blocks benchmarks/serve_bench_blocks.py

Written for vLLM's module tree: a decoder layer's output is ``(mlp_out, residual)``, whose sum is
the residual stream; a request's rows are its own tokens (``[-1]`` is its last position).
"""

from __future__ import annotations

from asyncpp.serve import Registry

blocks = Registry()


@blocks.block
async def read_every_layer(m):
    """At every generation step, every decoder layer's output (the request's own rows, as vLLM's
    ``(mlp_out, residual)``): how many rows of each layer the block was served ([layers] ints).
    What asyncpp costs a block that reads every layer, with next to no work of the block's own."""
    rows = None
    async for _step in m.steps():
        seen = [(await layer.output)[0].shape[0] for layer in m.model.layers]
        rows = seen if rows is None else [a + b for a, b in zip(rows, seen, strict=True)]
    return rows or []


@blocks.block
async def read_every_layer_norms(m):
    """At every generation step, every decoder layer's output: the mean over steps of the last
    position's residual-stream norm, per layer ([layers] floats). The same reads as
    ``read_every_layer`` plus three small torch ops of the block's own per read."""
    sums = None
    steps = 0
    async for _step in m.steps():
        norms = []
        for layer in m.model.layers:
            mlp_out, residual = await layer.output
            norms.append(float((mlp_out[-1] + residual[-1]).norm()))
        sums = norms if sums is None else [a + b for a, b in zip(sums, norms, strict=True)]
        steps += 1
    return [s / steps for s in sums] if sums else []


@blocks.block
async def read_one_layer(m):
    """The first decoder layer's output at the prompt: the last position's residual-stream norm."""
    mlp_out, residual = await m.model.layers[0].output
    return float((mlp_out[-1] + residual[-1]).norm())
