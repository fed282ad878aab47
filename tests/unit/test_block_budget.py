"""Block time budgets (kernel/budget.py): a block whose code runs past its budget in one step is
interrupted at its own line with BlockTimeoutError, fails alone, and the other blocks of the batch
get their values. Run here as a vLLM worker runs it: one long-lived interleaver and the controllers
on the process's main thread (the vLLM worker's own test is in test_serve_http.py)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import asyncpp
from asyncpp.kernel.budget import StepBudget
from asyncpp.kernel.interleaver import Interleaver
from asyncpp.locations.tree import build_tree
from asyncpp.native.controllers import Controllers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)]).eval()


def _run(model: nn.Module, blocks: list, seconds: float | None, fast: bool = True) -> list:
    """One forward of a 2-row batch, blocks[i] on row i, the way the vLLM worker drives them."""
    tree, modules, paths = build_tree(model, {})
    controllers = Controllers(modules)
    kernel = Interleaver(paths, 2, step_index=0, link=controllers.link)
    controllers.install(kernel)
    if seconds is not None:
        kernel.budget = StepBudget(seconds)
    if not fast:  # every resume through the kernel's Python code (else plain reads resume natively)
        controllers.link.fast = False
    try:
        with kernel.active():
            started = [kernel.start(b(tree), i, (i, i + 1), name=b.__name__) for i, b in enumerate(blocks)]
            out = model(torch.ones(2, 8))
            kernel.finish()
    finally:
        if kernel.budget is not None:
            kernel.budget.close()
        controllers.remove()
    return [(b.result, b.error) for b in started], out


async def sleeper(m):
    await m[0].output
    time.sleep(30)  # the budget stops this
    return "slept"


async def reader(m):
    return (await m[3].output).clone()


async def catcher(m):
    await m[0].output
    try:
        time.sleep(30)
    except asyncpp.BlockTimeoutError:
        pass
    await m[2].output  # it goes on waiting: it is closed at its next resume
    return "caught and went on"


async def busy(m):
    await m[1].output
    x = 0
    while True:  # pure Python, no sleep: interrupted all the same
        x += 1


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "kernel"])
def test_a_slow_block_fails_alone_at_its_line(fast):
    model = _model()
    expect = model(torch.ones(2, 8))[1:]
    (slow, fine), out = _run(model, [sleeper, reader], 0.2, fast)
    assert slow[0] is None and isinstance(slow[1], asyncpp.BlockTimeoutError)
    assert "'sleeper'" in str(slow[1]) and "0.2 s" in str(slow[1])
    assert f"{__file__}:" in str(slow[1])  # the line it was interrupted at
    assert fine[1] is None and torch.equal(fine[0], expect)
    assert torch.equal(out[1:], expect)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "kernel"])
def test_a_block_that_catches_the_timeout_is_closed_with_it(fast):
    (caught, fine), _ = _run(_model(), [catcher, reader], 0.2, fast)
    assert isinstance(caught[1], asyncpp.BlockTimeoutError) and caught[0] is None
    assert fine[1] is None


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "kernel"])
def test_python_loops_are_interrupted_too(fast):
    (looped, fine), _ = _run(_model(), [busy, reader], 0.2, fast)
    assert isinstance(looped[1], asyncpp.BlockTimeoutError)
    assert fine[1] is None


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "kernel"])
def test_blocks_within_budget_run_as_without_one(fast):
    model = _model()
    with_budget, out1 = _run(model, [reader, reader], 5.0, fast)
    without, out2 = _run(model, [reader, reader], None, fast)
    for (r1, e1), (r2, e2) in zip(with_budget, without, strict=True):
        assert e1 is None and e2 is None and torch.equal(r1, r2)
    assert torch.equal(out1, out2)


def test_budget_values_are_checked():
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="seconds > 0"):
            StepBudget.check(bad)


def test_tensor_parallel_engines_refuse_a_budget():
    pytest.importorskip("vllm")
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        asyncpp.VllmEngine(block_budget=1.0, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="seconds > 0"):
        asyncpp.VllmEngine(block_budget=-1)
