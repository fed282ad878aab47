"""Blocks an operator registers for `asyncpp serve`: clients name them and pass data only.

    .venv/bin/asyncpp serve --dtype float32 --blocks examples/serve_blocks.py

Each block declares its client parameters with types (`Tensor[dtype, max_shape]`, `Range`, ...):
the server checks a request's arguments against them before anything runs, and answers a mismatch
with 422. These blocks are written for vLLM's module tree (what `asyncpp serve` runs): a decoder
layer returns `(mlp_out, residual)`, whose sum is the residual stream; a request's rows are its own
tokens (`[-1]` is its last position); `m.logits` is `[1, vocab]`.

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

import json
import os
import sys
import types
from pathlib import Path
from typing import Annotated

import torch

from asyncpp.serve import Range, Registry, Tensor

blocks = Registry()

# The checkpoint whose final norm and unembedding the logit lens uses (on the workers; a vLLM block
# cannot call the model's own modules). Default: the embedded tiny model that `asyncpp serve` runs
# with no MODEL; set ASYNCPP_LENS_MODEL when you serve another one.
LENS_MODEL = os.environ.get("ASYNCPP_LENS_MODEL") or ""

Layer = Annotated[int, Range(0, 1023)]


def residual_stream(out):
    """A vLLM decoder layer's output `(mlp_out, residual)` as the residual stream (a new tensor)."""
    mlp_out, residual = out
    return mlp_out + residual


@blocks.block
async def steer(m, layer: Layer, vec: Tensor[torch.float32, (16384,)], scale: float = 1.0):
    """Add scale * vec to the residual stream after `layer`, at the last position, at every step; return step 0's next-token logits."""
    first = None
    async for _step in m.steps():
        mlp_out, _ = await m.model.layers[layer].output
        if vec.shape[0] != mlp_out.shape[-1]:
            raise ValueError(
                f"vec has {vec.shape[0]} entries, the model's hidden size is {mlp_out.shape[-1]}"
            )
        mlp_out[-1] += scale * vec.to(mlp_out.dtype)  # adds to the residual stream at the last token
        logits = await m.logits
        if first is None:
            first = logits[-1].float()
    return first


@blocks.block
async def read_layer(m, layer: Layer):
    """The residual stream after `layer` at the prompt's last position (float32, [hidden])."""
    return residual_stream(await m.model.layers[layer].output)[-1].float()


async def _lens_tops(m, k):
    """The logit lens at this step: each layer's last-position residual stream decoded with the
    final norm and the unembedding, its top-k token ids ([layers][k]). Awaited from a block."""
    norm_w, unembed, eps = _lens_weights()
    tops = []
    for layer in m.model.layers:
        h = residual_stream(await layer.output)[-1].float()
        normed = h * torch.rsqrt(h.pow(2).mean() + eps) * norm_w
        tops.append((unembed @ normed).topk(k).indices.tolist())
    return tops


@blocks.block
async def logit_lens(m, k: Annotated[int, Range(1, 20)] = 1):
    """Each layer's last-position residual stream decoded with the final norm and the unembedding: the top-k token ids per layer ([layers][k]), and the model's own top-k."""
    tops = await _lens_tops(m, k)
    logits = await m.logits
    return {"lens": tops, "logits": logits[-1].float().topk(k).indices.tolist()}


def _lens_weights():
    """(final norm weight, unembedding [vocab, hidden], rms eps) from the checkpoint, read once per
    worker process. The cache lives in `sys.modules`: the block's own module is pickled with each
    request (by value), so a module global would arrive empty every time."""
    cache = sys.modules.get("_asyncpp_example_lens_cache")
    if cache is None:
        cache = types.ModuleType("_asyncpp_example_lens_cache")
        cache.weights = {}
        sys.modules[cache.__name__] = cache
    path = LENS_MODEL
    if not path:
        from asyncpp.models import tiny_model_dir

        path = str(tiny_model_dir())
    if path not in cache.weights:
        cache.weights[path] = _load_unembedding(Path(path))
    return cache.weights[path]


def _load_unembedding(folder: Path):
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = None
    want_head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    out = {}
    for name in ("model.norm.weight", want_head):
        file = folder / (where[name] if where else "model.safetensors")
        with safe_open(str(file), "pt") as f:
            out[name] = f.get_tensor(name).float()
    return out["model.norm.weight"], out[want_head], float(config.get("rms_norm_eps", 1e-6))


@blocks.block
async def lens_stream(m, k: Annotated[int, Range(1, 20)] = 1):
    """A logit lens streamed at every generation step: emits {"step", "lens": the top-k token ids per layer at the last position, "logits": the model's own top-k} as each step is made; returns the number of steps."""
    import asyncpp

    n = 0
    async for _step in m.steps():
        tops = await _lens_tops(m, k)
        logits = await m.logits
        asyncpp.emit({"step": n, "lens": tops, "logits": logits[-1].float().topk(k).indices.tolist()})
        n += 1
    return n
