"""Run hooks and the controllers' contract: engine features are handed to the kernel at creation,
and whether the native fast path serves is derived from them (never from call order)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import asyncpp
from asyncpp.kernel.hooks import RunHooks
from asyncpp.kernel.interleaver import Interleaver
from asyncpp.locations.tree import build_tree
from asyncpp.native import enabled
from asyncpp.native.controllers import Controllers, PyRunLink, python_controllers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()


def test_every_hook_is_off_by_default_and_the_fast_path_follows_the_hooks():
    none = RunHooks()
    assert none.fast_path and none.special_modules() == frozenset()
    assert not RunHooks(publish=lambda *a: None).fast_path
    assert not RunHooks(intercept=lambda *a: None).fast_path
    assert RunHooks(on_step=lambda s: [], on_emit=lambda b, v: None).fast_path  # they see no values
    sharded = RunHooks(request_level=frozenset({3}), adapt_out={5: object()}, copy_after=frozenset({7}))
    assert sharded.special_modules() == {3, 5, 7}
    assert sharded.with_(copy_after=frozenset()).special_modules() == {3, 5}
    names = ["", "a", "b"]
    assert Interleaver(names, 1).fast_path
    assert not Interleaver(names, 1, grad=True).fast_path  # gradient runs keep every served value
    assert not Interleaver(names, 1, hooks=RunHooks(publish=lambda *a: None)).fast_path


@pytest.mark.parametrize("hooks", [RunHooks(), RunHooks(publish=lambda *a: None)], ids=["plain", "publish"])
def test_the_link_gets_the_fast_path_the_hooks_allow_whatever_was_set_up_first(hooks):
    model = _model()
    _, modules, paths = build_tree(model, {})
    for order in ("controllers first", "kernel first"):
        if order == "controllers first":
            controllers = Controllers(modules)
            kernel = Interleaver(paths, 1, step_index=0, hooks=hooks, link=controllers.link)
        else:
            kernel = Interleaver(paths, 1, step_index=0, hooks=hooks)
            controllers = Controllers(modules)
            kernel.link = controllers.link
        controllers.install(kernel)
        try:
            assert controllers.link.kernel is kernel
            assert controllers.link.fast == (hooks.fast_path and controllers.native), order
        finally:
            controllers.remove()
        assert controllers.link.kernel is None and not controllers.link.fast
        assert "forward" not in modules[1].__dict__  # the model carries no asyncpp state after


def test_a_publish_hook_sees_every_served_value_on_either_controllers():
    seen = []
    model = _model()
    tree, modules, paths = build_tree(model, {})
    controllers = Controllers(modules)
    hooks = RunHooks(publish=lambda index, kind, n, value, due: seen.append((paths[index], len(due))))
    kernel = Interleaver(paths, 1, step_index=0, hooks=hooks, link=controllers.link)

    async def reads(m):
        a = await m[0].output
        b = await m[2].output
        return a.sum() + b.sum()

    controllers.install(kernel)
    try:
        with kernel.active():
            block = kernel.start(reads(tree), 0)
            out = model(torch.ones(1, 4))
            kernel.finish()
    finally:
        controllers.remove()
    assert block.error is None, block.error
    assert seen == [("0", 1), ("2", 1)]  # (the native fast path would have served them unseen)
    assert out.shape == (1, 4)


def test_python_controllers_are_chosen_by_the_environment():
    model = _model()
    _, modules, _ = build_tree(model, {})
    controllers = Controllers(modules)
    assert controllers.native == (enabled() and not python_controllers())
    assert isinstance(controllers.link, PyRunLink) == python_controllers()
    code = (
        "from asyncpp.native.controllers import Controllers; from torch import nn; "
        "print(Controllers([nn.Linear(2, 2)]).native)"
    )
    env = {**os.environ, "ASYNCPP_CONTROLLERS": "python"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_same_trace_gives_the_same_values_on_either_controllers(monkeypatch):
    """The whole local suite runs both ways (make test); this compares the two in one process."""
    from asyncpp.engines.local.engine import LocalEngine

    model = _model()
    x = torch.randn(3, 4)

    async def edit(m):
        h = await m[0].output
        await m[0].output.set(h * 2)
        return (await m[2].output).clone()

    results = []
    for choice in ("native", "python"):
        monkeypatch.setenv("ASYNCPP_CONTROLLERS", choice)
        engine = LocalEngine(model)  # (engines pick their controllers when created)
        try:
            with asyncpp.trace(engine) as t:
                inv = t.invoke(x, edit)
            results.append(inv.result)
        finally:
            engine.close()
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    torch.testing.assert_close(results[0], model[2](model[1](model[0](x) * 2)), rtol=0, atol=0)


def test_a_single_whole_batch_read_of_a_module_the_hooks_transform_still_goes_through_them():
    """copy_after (and shards) apply to a visit even when one plain read is its only wait."""
    model = _model()
    tree, modules, paths = build_tree(model, {})
    first = paths.index("0")
    kept = {}

    class Spy(nn.Module):
        def forward(self, x):
            kept["model"] = x
            return x

    model[1] = Spy()  # (sees what the model goes on with after module 0)
    tree, modules, paths = build_tree(model, {})
    controllers = Controllers(modules)
    hooks = RunHooks(copy_after=frozenset({first}))
    kernel = Interleaver(paths, 2, step_index=0, hooks=hooks, link=controllers.link)

    async def read(m):
        kept["block"] = await m[0].output

    controllers.install(kernel)
    try:
        with kernel.active():
            block = kernel.start(read(tree), 0)
            model(torch.ones(2, 4))
            kernel.finish()
    finally:
        controllers.remove()
    assert block.error is None, block.error
    assert kept["model"] is not kept["block"]  # the model got a copy of what the block was served
    torch.testing.assert_close(kept["model"], kept["block"])
