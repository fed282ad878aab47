"""A meta-device copy of a pipeline stage's full architecture, grafted under its placeholders.

On a pipeline-parallel vLLM engine each stage loads only its own layers; the others are
``PPMissingLayer`` placeholders. To make every path of the full model resolve on every stage (with
the real module's type, in the same order as on one stage) the worker builds the model a second
time on the meta device (no memory for weights) with the engine's own config, seeing a one-stage
pipeline for that moment, and grafts its modules under the placeholders (:mod:`asyncpp.pp.graft`).

Building it must not disturb the live engine: vLLM's attention layers register themselves by name
in the compilation config's static forward context (a duplicate name raises, and the KV cache is
allocated for what is registered there), so the copy is built against a config whose registries
are its own, and afterwards :func:`build_full_model` checks that the live config and the other
process-wide state construction touches are as they were.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...pp.graft import Grafted, graft


@dataclass
class GraftCost:
    """What grafting cost on this worker: build time, resident memory, modules added."""

    seconds: float
    rss_bytes: int  # growth of the process's resident memory across build and graft
    tensor_bytes: int  # bytes of the copy's own parameters and buffers that are not on the meta device
    modules: int  # modules registered under the placeholders


class _OneStage:
    """The pipeline group as model constructors see it while the full copy is built: one stage
    holding every layer. Everything else is the real group's."""

    def __init__(self, real: Any):
        self._real = real

    world_size = 1
    rank_in_group = 0
    is_first_rank = True
    is_last_rank = True

    @property
    def ranks(self) -> list[int]:
        return [self._real.rank]

    @property
    def first_rank(self) -> int:
        return self._real.rank

    @property
    def last_rank(self) -> int:
        return self._real.rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _private_config(vllm_config: Any) -> Any:
    """A shallow copy of the engine's config whose compilation config has registries of its own
    (an empty static forward context, copies of the other lists, dicts, sets and counters)."""
    cc = copy.copy(vllm_config.compilation_config)
    for name, value in list(vars(cc).items()):
        if isinstance(value, (dict, list, set)):
            setattr(cc, name, copy.copy(value))
    cc.static_forward_context = {}
    private = copy.copy(vllm_config)
    private.compilation_config = cc
    return private


class _Globals:
    """The process-wide state building a model may touch, captured to check it afterwards."""

    def __init__(self, vllm_config: Any):
        import vllm.config.vllm as config_module
        import vllm.distributed.parallel_state as ps
        import vllm.model_executor.offloader.base as offloader
        from vllm.compilation.counter import compilation_counter

        cc = vllm_config.compilation_config
        self.cc = cc
        self.context = dict(cc.static_forward_context)
        self.moe = list(getattr(cc, "static_all_moe_layers", []))
        self.ops = (copy.copy(cc.enabled_custom_ops), copy.copy(cc.disabled_custom_ops))
        self.counter = dataclasses.replace(compilation_counter)
        self.groups = (ps._PP, ps._TP)
        self.offloader = offloader._instance
        self.current = config_module._current_vllm_config
        self.dtype = torch.get_default_dtype()

    def check(self) -> None:
        """Raise if anything captured changed (after putting the forward context back)."""
        import vllm.config.vllm as config_module
        import vllm.distributed.parallel_state as ps
        import vllm.model_executor.offloader.base as offloader
        from vllm.compilation.counter import compilation_counter

        cc = self.cc
        # the copy is never compiled: counting it as a model seen would be wrong
        for f in dataclasses.fields(compilation_counter):
            setattr(compilation_counter, f.name, getattr(self.counter, f.name))
        changed = []
        ctx = cc.static_forward_context
        if ctx.keys() != self.context.keys() or any(ctx[k] is not v for k, v in self.context.items()):
            changed.append(f"static forward context ({sorted(set(ctx) ^ set(self.context))[:4]})")
            ctx.clear()
            ctx.update(self.context)
        if list(getattr(cc, "static_all_moe_layers", [])) != self.moe:
            changed.append("static_all_moe_layers")
        if (cc.enabled_custom_ops, cc.disabled_custom_ops) != self.ops:
            changed.append("custom op counters")
        if (ps._PP, ps._TP) != self.groups:
            changed.append("the parallel groups")
        if offloader._instance is not self.offloader:
            changed.append("the offloader")
        if config_module._current_vllm_config is not self.current:
            changed.append("the current vLLM config")
        if torch.get_default_dtype() != self.dtype:
            changed.append("the default dtype")
        if changed:
            raise RuntimeError(f"building the meta copy changed the live engine's {', '.join(changed)}")


@contextlib.contextmanager
def _one_stage_pipeline() -> Iterator[None]:
    """For the block's duration: the PP group says one stage, the layer split gives it every layer,
    and modules are wrapped by no offloader; the real ones come back after."""
    import vllm.distributed.parallel_state as ps
    import vllm.distributed.utils as dist_utils
    import vllm.model_executor.offloader.base as offloader

    real_pp, real_split, real_offloader = ps._PP, dist_utils.get_pp_indices, offloader._instance
    ps._PP = _OneStage(real_pp)
    dist_utils.get_pp_indices = lambda num_layers, rank, size: (0, num_layers)
    offloader._instance = offloader.NoopOffloader()
    try:
        yield
    finally:
        ps._PP, dist_utils.get_pp_indices, offloader._instance = real_pp, real_split, real_offloader


def build_full_model(model: nn.Module, vllm_config: Any) -> nn.Module:
    """The live model's class built again with every layer, on the meta device, from the engine's
    config (dtype, tensor-parallel sharding, quantization), leaving the live engine as it was."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    private = _private_config(vllm_config)
    before = _Globals(vllm_config)
    try:
        with (
            _one_stage_pipeline(),
            set_default_torch_dtype(vllm_config.model_config.dtype),
            torch.device("meta"),
            set_current_vllm_config(private, prefix=""),
        ):
            full = type(model)(vllm_config=private, prefix="")
    finally:
        before.check()
    return full


def graft_full_model(model: nn.Module, vllm_config: Any) -> tuple[Grafted, GraftCost]:
    """Build the meta copy and graft it under ``model``'s placeholders; also what that cost."""
    live = {id(t) for t in [*model.parameters(), *model.buffers()]}
    rss0, t0 = _rss(), time.perf_counter()
    full = build_full_model(model, vllm_config)
    done = graft(model, full)
    seconds = time.perf_counter() - t0
    # tensors the copy allocated for real (modules vLLM caches, like the rotary embedding, are shared)
    real_bytes = sum(
        t.numel() * t.element_size()
        for t in [*full.parameters(), *full.buffers()]
        if t.device.type != "meta" and id(t) not in live
    )
    return done, GraftCost(seconds, _rss() - rss0, real_bytes, done.modules)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
