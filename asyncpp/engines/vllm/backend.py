"""Models vLLM runs through its Transformers backend, seen as flat token rows.

vLLM runs a model it has no class of its own for (Phi, GPT-NeoX / Pythia, OLMo, ...), or any model
with ``model_impl="transformers"``, by calling the Hugging Face modules on all of a step's tokens
as one sequence: every module below the backend's ``model`` sees ``[1, tokens, ...]``, where vLLM's
own classes see ``[tokens, ...]``. The kernel narrows a block's rows along the first dimension, so
at a visit some block waits on those values are served with the batch dimension of one dropped
(views: in-place edits land in the model) and the model goes on with it put back. Some Hugging Face
modules flatten the tokens for their children (a mixture of experts' router and experts): a value
counts as batched only when its second dimension is the step's number of tokens. The attention
layers vLLM hangs inside the Hugging Face attention modules already take flat tokens and are left
as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

_PACKAGE = "vllm.model_executor.models.transformers"


def is_backend_model(model: nn.Module) -> bool:
    """Whether vLLM runs ``model`` through its Transformers backend."""
    return type(model).__module__.startswith(_PACKAGE)


def family(model: nn.Module, hf_config: Any) -> str | None:
    """The Hugging Face class a backend model wraps (``PhiForCausalLM``): its standard-view family;
    None for vLLM's own model classes, whose class names say it."""
    if not is_backend_model(model):
        return None
    names = getattr(hf_config, "architectures", None) or []
    return names[0] if names else None


def _batched(t: Tensor, tokens: int) -> bool:
    """Whether ``t`` holds the step's tokens behind a batch dimension of one, ``[1, tokens, ...]``
    (not a value some module takes flat, ``[tokens, ...]``, as a mixture of experts' router does)."""
    return t.ndim >= 2 and t.shape[0] == 1 and t.shape[1] == tokens


def _drop(value: Any, tokens: int) -> Any:
    if isinstance(value, Tensor):
        return value[0] if _batched(value, tokens) else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_drop(v, tokens) for v in value)
    if isinstance(value, list):
        return [_drop(v, tokens) for v in value]
    if isinstance(value, dict):
        return {k: _drop(v, tokens) for k, v in value.items()}
    return value


def _is_row_view(seen: Tensor, held: Tensor) -> bool:
    """Whether ``seen`` is ``held[0]`` itself (what :func:`_drop` served, maybe edited in place)."""
    return (
        seen.data_ptr() == held.data_ptr()
        and seen.shape == held.shape[1:]
        and seen.stride() == held.stride()[1:]
    )


def _restore(seen: Any, held: Any, tokens: int) -> Any:
    if isinstance(held, Tensor):
        if not isinstance(seen, Tensor) or not _batched(held, tokens):
            return seen
        if _is_row_view(seen, held):
            return held
        return seen.unsqueeze(0) if seen.ndim == held.ndim - 1 else seen
    if isinstance(held, tuple) and not hasattr(held, "_fields"):
        if isinstance(seen, tuple) and len(seen) == len(held):
            return tuple(_restore(s, h, tokens) for s, h in zip(seen, held))
        return seen
    if isinstance(held, list) and isinstance(seen, list) and len(seen) == len(held):
        return [_restore(s, h, tokens) for s, h in zip(seen, held)]
    if isinstance(held, dict) and isinstance(seen, dict):
        return {k: _restore(v, held[k], tokens) if k in held else v for k, v in seen.items()}
    return seen


class DropBatchDim:
    """The adapter of backend modules' outputs (``RunHooks.adapt_out``): tensors shaped
    ``[1, tokens, ...]``, inside tuples, lists and dicts, are served as ``[tokens, ...]``;
    ``tokens()`` gives the number of token rows of the step being run."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: Callable[[], int]):
        self.tokens = tokens

    def to_blocks(self, held: Any) -> Any:
        return _drop(held, self.tokens())

    def to_model(self, seen: Any, held: Any) -> Any:
        return _restore(seen, held, self.tokens())


class DropBatchDimOfCall(DropBatchDim):
    """The same for a call's ``(args, kwargs)`` (``RunHooks.adapt_in``)."""

    __slots__ = ()

    def to_blocks(self, held: tuple[tuple, dict]) -> tuple[tuple, dict]:
        n = self.tokens()
        return _drop(held[0], n), _drop(held[1], n)

    def to_model(self, seen: tuple[tuple, dict], held: tuple[tuple, dict]) -> tuple[tuple, dict]:
        n = self.tokens()
        return _restore(tuple(seen[0]), held[0], n), _restore(dict(seen[1]), held[1], n)


class Gathered:
    """A backend module's value that tensor parallelism also splits across the ranks: made whole
    first (``shard``, an adapter of tensor_parallel.py), then served without its batch dimension
    of one (``drop``); back to the model in the reverse order."""

    __slots__ = ("drop", "shard")

    def __init__(self, drop: DropBatchDim, shard: Any):
        self.drop, self.shard = drop, shard

    def to_blocks(self, held: Any) -> Any:
        return self.drop.to_blocks(self.shard.to_blocks(held))

    def to_model(self, seen: Any, held: Any) -> Any:
        return self.shard.to_model(self.drop.to_model(seen, held), held)


def batch_dim_adapters(
    model: nn.Module,
    modules: list[nn.Module],
    paths: list[str],
    tokens: Callable[[], int],
    shardings: tuple[dict[int, Any], dict[int, Any]],
) -> tuple[dict[int, Any], dict[int, Any]]:
    """The kernel's output and input adapters: the tensor-parallel ``shardings`` (output, input),
    and for a backend model the batch dimension dropped below its ``model`` (vLLM's attention
    layers inside take flat tokens: they are left alone); ``tokens()``: the number of token rows
    of the step being run."""
    if not is_backend_model(model):
        return shardings
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    flat = {id(m) for top in model.modules() if isinstance(top, AttentionLayerBase) for m in top.modules()}
    adapters = DropBatchDim(tokens), DropBatchDimOfCall(tokens)
    adapted = [
        i
        for i, (m, p) in enumerate(zip(modules, paths))
        if m is not None and (p == "model" or p.startswith("model.")) and id(m) not in flat
    ]
    merged: list[dict[int, Any]] = []
    for drop, shard in zip(adapters, shardings):
        both = dict.fromkeys(adapted, drop)
        for i, s in shard.items():
            both[i] = Gathered(drop, s) if i in both else s
        merged.append(both)
    return merged[0], merged[1]


def split_paths(model: nn.Module) -> tuple[str, ...] | None:
    """The paths of the modules the backend splits across pipeline stages: those of the Hugging
    Face model's pipeline plan (else its decoder's children with parameters) and ``lm_head``.
    Every other module runs on every stage that builds it (a base model's rotary embedding).
    None for vLLM's own model classes."""
    if not is_backend_model(model):
        return None
    base = model.model
    if getattr(base, "supports_pp_plan", False):
        paths = [f"model.{name}" for name in base._pp_plan]
    else:
        decoder = base.get_decoder()
        prefix = next(p for p, m in model.named_modules() if m is decoder)
        paths = [
            f"{prefix}.{n}" for n, c in decoder.named_children() if next(c.parameters(), None) is not None
        ]
    return (*paths, "lm_head")


__all__ = [
    "DropBatchDim",
    "DropBatchDimOfCall",
    "Gathered",
    "batch_dim_adapters",
    "is_backend_model",
    "split_paths",
]
