"""Tensor parallel values made whole for blocks, and split again for the model.

Inside a TP group, column-parallel linears (fused QKV, gate/up) produce each rank's slice of their
output along the last dimension, and row-parallel linears take such slices as input. A block must
see the whole tensor in the logical layout (all of q, then all of k, then all of v), so a served
value is all-gathered across the group and re-ordered by sub-output; after the blocks ran, each
rank keeps its slice of the possibly edited whole.

Every rank of the group runs the same blocks on the same scheduler output, so every rank decides
to gather at the same visits: the decision comes from the blocks' waits, never from local data.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


class _PerTensor:
    """An adapter of one tensor, which also takes a linear's ``(output, bias)``: the output is
    adapted, the rest passes as it is."""

    __slots__ = ()

    def to_blocks(self, value: Any) -> Any:
        if isinstance(value, tuple):
            return (self.to_blocks(value[0]), *value[1:])
        return self._whole(value)

    def to_model(self, whole: Any, local: Any) -> Any:
        if isinstance(whole, tuple):
            return (self.to_model(whole[0], local[0]), *whole[1:])
        return self._part(whole, local)

    def _whole(self, value: Any) -> Any:
        raise NotImplementedError

    def _part(self, whole: Any, local: Any) -> Any:
        raise NotImplementedError


class Sharding(_PerTensor):
    """How one value is split across the TP group: the per-rank widths of its sub-outputs, and
    for each how many ranks hold the same slice (key/value heads replicated where the group is
    larger than their number); for an attention layer's values, the size of a head, which a
    value may have a dimension of its own for (``[tokens, heads, head_size]``)."""

    __slots__ = ("local_sizes", "replicas", "head_size", "tp", "rank", "group")

    def __init__(
        self,
        local_sizes: list[int],
        tp: int,
        rank: int,
        group: Any,
        replicas: list[int] | None = None,
        head_size: int = 0,
    ):
        self.local_sizes = list(local_sizes)
        self.replicas = list(replicas) if replicas else [1] * len(self.local_sizes)
        self.head_size = head_size
        self.tp, self.rank, self.group = tp, rank, group

    def _whole(self, value: Any) -> Any:
        """The whole of this rank's slice ``value`` (all-gathered across the group)."""
        head = self._head(value)
        if head is None:
            return value
        flat = value.flatten(-2) if head else value
        sizes = self.local_sizes
        per_rank = self.group.all_gather(flat.contiguous(), dim=-1).split(sum(sizes), dim=-1)
        subs = [p.split(sizes, dim=-1) for p in per_rank]
        whole = torch.cat(
            [subs[r][j] for j, step in enumerate(self.replicas) for r in range(0, self.tp, step)], dim=-1
        )
        return whole.unflatten(-1, (-1, head)) if head else whole

    def _part(self, whole: Any, local: Any) -> Any:
        """This rank's slice of ``whole`` (shaped like ``local``, the value before the gather)."""
        head = self._head(local)
        if head is None or not isinstance(whole, Tensor):
            return whole
        flat = whole.flatten(-2) if head else whole
        sizes, replicas = self.local_sizes, self.replicas
        pieces = flat.split([n * self.tp // step for n, step in zip(sizes, replicas)], dim=-1)
        mine = [p.narrow(-1, self.rank // step * n, n) for p, n, step in zip(pieces, sizes, replicas)]
        out = torch.cat(mine, dim=-1)
        if out.numel() == local.numel() and out.dtype == local.dtype:
            local.copy_(out.view(local.shape))  # in place: the model may hold this very tensor
            return local
        return out

    def _head(self, local: Any) -> int | None:
        """How this rank's ``local`` value is laid out: 0 for ``[..., width]``, the head size for
        ``[..., heads, head_size]``, None where it is no tensor of this rank's width (a value the
        model already made whole, as some families do before a norm of all the heads)."""
        if not isinstance(local, Tensor) or local.ndim == 0:
            return None
        width, head = sum(self.local_sizes), self.head_size
        if head and local.ndim >= 3 and local.shape[-1] == head and local.shape[-2] * head == width:
            return head
        return 0 if local.shape[-1] == width else None


class Arguments:
    """A call some of whose arguments are sharded (a row-parallel linear's input, an activation's,
    the query, key and value of an attention layer), by position or keyword, as an adapter of the
    call's ``(args, kwargs)``."""

    __slots__ = ("by_position", "by_name")

    def __init__(self, by_position: dict[int, Sharding], by_name: dict[str, Sharding] | None = None):
        self.by_position, self.by_name = by_position, by_name or {}

    def to_blocks(self, call: tuple[tuple, dict]) -> tuple[tuple, dict]:
        args, kwargs = call
        pos, names = self.by_position, self.by_name
        args = tuple(pos[i].to_blocks(a) if i in pos else a for i, a in enumerate(args))
        if names and kwargs:
            kwargs = {k: names[k].to_blocks(v) if k in names else v for k, v in kwargs.items()}
        return args, kwargs

    def to_model(self, call: tuple[tuple, dict], held: tuple[tuple, dict]) -> tuple[tuple, dict]:
        args, kwargs = call
        pos, names = self.by_position, self.by_name
        old_args, old_kwargs = held
        args = tuple(
            pos[i].to_model(a, old_args[i]) if i in pos and i < len(old_args) else a
            for i, a in enumerate(args)
        )
        if names and kwargs:
            kwargs = {
                k: names[k].to_model(v, old_kwargs[k]) if k in names and k in old_kwargs else v
                for k, v in kwargs.items()
            }
        return args, kwargs


class Elements:
    """A tuple output some of whose elements are sharded (a rotary embedding's ``(query, key)``)."""

    __slots__ = ("by_position",)

    def __init__(self, by_position: dict[int, Sharding]):
        self.by_position = by_position

    def to_blocks(self, value: Any) -> Any:
        if not isinstance(value, tuple):
            return value
        pos = self.by_position
        return tuple(pos[i].to_blocks(v) if i in pos else v for i, v in enumerate(value))

    def to_model(self, whole: Any, local: Any) -> Any:
        if not isinstance(whole, tuple) or not isinstance(local, tuple):
            return whole
        pos = self.by_position
        return tuple(
            pos[i].to_model(v, local[i]) if i in pos and i < len(local) else v for i, v in enumerate(whole)
        )


class PartialSum(_PerTensor):
    """A value each rank holds a part of, to be summed across the group later (a row-parallel
    linear that leaves its reduction to its caller, a mixture of experts' expert computation):
    served as the sum; an edit goes back as its difference from that sum, added on the first rank
    (the model's own reduction then gives the edited value)."""

    __slots__ = ("rank", "group")

    def __init__(self, rank: int, group: Any):
        self.rank, self.group = rank, group

    def _whole(self, value: Any) -> Any:
        return self.group.all_reduce(value.clone()) if isinstance(value, Tensor) else value

    def _part(self, whole: Any, local: Any) -> Any:
        if not isinstance(whole, Tensor) or not isinstance(local, Tensor) or whole.shape != local.shape:
            return whole
        delta = whole - self.group.all_reduce(local.clone())  # (zero where nothing was edited)
        if self.rank == 0:
            local.add_(delta)
        return local


def find_shardings(modules: list[nn.Module], paths: list[str]) -> tuple[dict[int, Any], dict[int, Arguments]]:
    """The module indices whose output (first dict) or arguments (second) are TP-sharded, as the
    kernel's adapters (``RunHooks.adapt_out`` / ``adapt_in``)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return {}, {}
    rank, group = get_tensor_model_parallel_rank(), get_tp_group()

    def sharding(sizes: list[int], replicas: list[int] | None = None, head_size: int = 0) -> Sharding:
        return Sharding(sizes, tp, rank, group, replicas, head_size)

    outputs: dict[int, Any] = {}
    inputs: dict[int, Arguments] = {}
    children: dict[str, list[int]] = {}
    index_of = {path: index for index, path in enumerate(paths)}
    for index, path in enumerate(paths):
        children.setdefault(path.rpartition(".")[0], []).append(index)

    def siblings(index: int) -> list[int]:
        return [i for i in children.get(paths[index].rpartition(".")[0], ()) if i != index]

    for index, (module, path) in enumerate(zip(modules, paths)):
        if isinstance(module, ColumnParallelLinear) and not getattr(module, "gather_output", False):
            outputs[index] = sharding(_column_sizes(module), _column_replicas(module))
        elif isinstance(module, FusedMoEMethodBase):  # the experts' output, before any reduction
            outputs[index] = PartialSum(rank, group)
        elif isinstance(module, RowParallelLinear):
            if not getattr(module, "reduce_results", True):
                outputs[index] = PartialSum(rank, group)
                owner = index_of.get(path.rpartition(".")[0])
                if owner is not None and modules[owner] is not None and not _reduces(modules[owner]):
                    outputs[owner] = PartialSum(rank, group)  # it returns the part as it is
            if not getattr(module, "input_is_parallel", True):
                continue
            width = module.input_size_per_partition
            inputs[index] = Arguments({0: sharding([width])})
            name = path.rpartition(".")[2]
            near = siblings(index)
            alone = not any(isinstance(modules[i], RowParallelLinear) for i in near)
            columns = [i for i in near if isinstance(modules[i], ColumnParallelLinear)]
            for i in near:
                attention = isinstance(modules[i], AttentionLayerBase)
                if not _feeds(modules[i], paths[i].rpartition(".")[2], name, alone, attention):
                    continue
                outputs[i] = sharding([width])
                if len(columns) == 1 and not attention:
                    # an activation: its input is the one column-parallel linear's output
                    inputs[i] = Arguments({0: sharding(_column_sizes(modules[columns[0]]))})
    for index, module in enumerate(modules):
        if not isinstance(module, AttentionLayerBase):
            continue
        near = siblings(index)
        qkv = [modules[i] for i in near if isinstance(modules[i], ColumnParallelLinear)]
        q, k, v = _head_shardings(module, qkv[0] if len(qkv) == 1 else None, sharding)
        if q is None:
            continue
        inputs[index] = Arguments({0: q, 1: k, 2: v}, {"query": q, "key": k, "value": v})
        for i in near:
            name = paths[i].rpartition(".")[2]
            if type(modules[i]).__module__.startswith(_ROTARY):
                inputs[i] = Arguments({1: q, 2: k}, {"query": q, "key": k})
                outputs[i] = Elements({0: q, 1: k})
            elif name in _HEAD_NORMS:  # a norm of each head: [tokens, heads, head size]
                one = q if _HEAD_NORMS[name] == "q" else k
                inputs[i], outputs[i] = Arguments({0: one}), one
    return outputs, inputs


def _reduces(module: nn.Module) -> bool:
    """Whether ``module``'s own forward sums its parts across the group (its code calls an
    all-reduce); where the source cannot be read, assume it does (its output is then served as it
    is, as before: never summed twice)."""
    try:
        code = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return True
    return "all_reduce" in code or "reduce_scatter" in code


def _column_sizes(module: nn.Module) -> list[int]:
    return list(getattr(module, "output_partition_sizes", None) or [module.output_size_per_partition])


def _column_replicas(module: nn.Module) -> list[int] | None:
    """A fused QKV projection's replicas per sub-output: (1, r, r) where the group is larger than
    the number of key/value heads and each of them is held by r ranks."""
    r = getattr(module, "num_kv_head_replicas", 1)
    sizes = _column_sizes(module)
    return [1, r, r] if r > 1 and len(sizes) == 3 else None


def _head_shardings(attn: nn.Module, qkv: nn.Module | None, sharding: Callable) -> tuple[Any, Any, Any]:
    """The shardings of an attention layer's query, key and value: this rank's heads (None where
    the layer does not say how many it has)."""
    heads, kv_heads = getattr(attn, "num_heads", None), getattr(attn, "num_kv_heads", None)
    size = getattr(attn, "head_size", None)
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(size, int)):
        return None, None, None
    v_size = getattr(attn, "head_size_v", None) or size
    r = getattr(qkv, "num_kv_head_replicas", 1) if qkv is not None else 1
    return (
        sharding([heads * size], None, size),
        sharding([kv_heads * size], [r], size),
        sharding([kv_heads * v_size], [r], v_size),
    )


# vLLM's rotary embeddings: called with (positions, query, key) of this rank's heads
_ROTARY = "vllm.model_executor.layers.rotary_embedding"
# the norms of each query and key head beside an attention layer (Qwen3, Gemma-3): this rank's heads
_HEAD_NORMS = {"q_norm": "q", "k_norm": "k"}
# where a module's output is a row-parallel linear's input, by the names vLLM's Llama gives them
_FEEDS = (("act_fn", "down_proj"), ("attn", "o_proj"))
# the packages whose modules are activation functions (elementwise: a slice in, the slice out)
_ACTIVATIONS = (
    "vllm.model_executor.layers.activation",
    "torch.nn.modules.activation",
    "transformers.activations",
)


def _feeds(module: nn.Module | None, sibling: str, row: str, alone: bool, attention: bool) -> bool:
    """Whether ``module`` (named ``sibling``) makes the input of its sibling ``row``, a
    row-parallel linear: by vLLM's Llama names, or, where ``row`` is its parent's only
    row-parallel linear, an attention layer (its output projection's input: the local heads) or
    an activation function (GPT-2's ``attn`` -> ``c_proj`` and ``act`` -> ``c_proj``)."""
    if (sibling, row) in _FEEDS:
        return True
    if module is None or not alone:
        return False
    return attention or type(module).__module__ in _ACTIVATIONS
