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

from typing import Any

import torch
from torch import Tensor, nn


class Sharding:
    """How one module's value is split across the TP group: per-rank widths of its sub-outputs."""

    __slots__ = ("local_sizes", "tp", "rank", "group")

    def __init__(self, local_sizes: list[int], tp: int, rank: int, group: Any):
        self.local_sizes = list(local_sizes)
        self.tp, self.rank, self.group = tp, rank, group

    def to_blocks(self, value: Any) -> Any:
        """The whole of this rank's slice ``value`` (all-gathered across the group)."""
        if isinstance(value, tuple):  # a linear's (output, bias)
            return (self.to_blocks(value[0]), *value[1:])
        if not isinstance(value, Tensor):
            return value
        parts = self.group.all_gather(value.contiguous(), dim=-1)  # [.. | rank0 | rank1 | ..]
        width = sum(self.local_sizes)
        per_rank = parts.split(width, dim=-1)
        subs = [p.split(self.local_sizes, dim=-1) for p in per_rank]
        return torch.cat(
            [torch.cat([s[j] for s in subs], dim=-1) for j in range(len(self.local_sizes))], dim=-1
        )

    def to_model(self, whole: Any, local: Any) -> Any:
        """This rank's slice of ``whole`` (shaped like ``local``, the value before the gather)."""
        if isinstance(whole, tuple):
            return (self.to_model(whole[0], local[0]), *whole[1:])
        if not isinstance(whole, Tensor):
            return whole
        pieces = whole.split([n * self.tp for n in self.local_sizes], dim=-1)
        mine = [p.narrow(-1, self.rank * n, n) for p, n in zip(pieces, self.local_sizes)]
        out = torch.cat(mine, dim=-1)
        if isinstance(local, Tensor) and out.shape == local.shape and out.dtype == local.dtype:
            local.copy_(out)  # in place: the model may hold this very tensor (a fused buffer)
            return local
        return out


class FirstArgument:
    """A call whose first positional argument is sharded (a row-parallel linear's input), as an
    adapter of the call's ``(args, kwargs)``."""

    __slots__ = ("sharding",)

    def __init__(self, sharding: Sharding):
        self.sharding = sharding

    def to_blocks(self, call: tuple[tuple, dict]) -> tuple[tuple, dict]:
        args, kwargs = call
        return ((self.sharding.to_blocks(args[0]), *args[1:]), kwargs) if args else call

    def to_model(self, call: tuple[tuple, dict], held: tuple[tuple, dict]) -> tuple[tuple, dict]:
        args, kwargs = call
        if not args or not held[0]:
            return call
        return (self.sharding.to_model(args[0], held[0][0]), *args[1:]), kwargs


def find_shardings(
    modules: list[nn.Module], paths: list[str]
) -> tuple[dict[int, Sharding], dict[int, FirstArgument]]:
    """The module indices whose output (first dict) or first input (second) is TP-sharded, as the
    kernel's adapters (``RunHooks.adapt_out`` / ``adapt_in``)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return {}, {}
    rank, group = get_tensor_model_parallel_rank(), get_tp_group()
    outputs: dict[int, Sharding] = {}
    inputs: dict[int, FirstArgument] = {}
    children: dict[str, list[int]] = {}
    for index, path in enumerate(paths):
        children.setdefault(path.rpartition(".")[0], []).append(index)
    for index, (module, path) in enumerate(zip(modules, paths)):
        if isinstance(module, ColumnParallelLinear) and not getattr(module, "gather_output", False):
            sizes = list(
                getattr(module, "output_partition_sizes", None) or [module.output_size_per_partition]
            )
            outputs[index] = Sharding(sizes, tp, rank, group)
        elif isinstance(module, RowParallelLinear) and getattr(module, "input_is_parallel", True):
            width = module.input_size_per_partition
            inputs[index] = FirstArgument(Sharding([width], tp, rank, group))
            parent, _, name = path.rpartition(".")
            siblings = [i for i in children.get(parent, ()) if i != index]
            alone = not any(isinstance(modules[i], RowParallelLinear) for i in siblings)
            for i in siblings:
                if _feeds(modules[i], paths[i].rpartition(".")[2], name, alone):
                    outputs[i] = Sharding([width], tp, rank, group)
    return outputs, inputs


# where a module's output is a row-parallel linear's input, by the names vLLM's Llama gives them
_FEEDS = (("act_fn", "down_proj"), ("attn", "o_proj"))
# the packages whose modules are activation functions (elementwise: a slice in, the slice out)
_ACTIVATIONS = (
    "vllm.model_executor.layers.activation",
    "torch.nn.modules.activation",
    "transformers.activations",
)


def _feeds(module: nn.Module | None, sibling: str, row: str, alone: bool) -> bool:
    """Whether ``module`` (named ``sibling``) makes the input of its sibling ``row``, a
    row-parallel linear: by vLLM's Llama names, or, where ``row`` is its parent's only
    row-parallel linear, an attention layer (its output projection's input: the local heads) or
    an activation function (GPT-2's ``attn`` -> ``c_proj`` and ``act`` -> ``c_proj``)."""
    if (sibling, row) in _FEEDS:
        return True
    if module is None or not alone:
        return False
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return isinstance(module, AttentionLayerBase) or type(module).__module__ in _ACTIVATIONS
