"""Torch thread-local state is isolated per block by the C++ swap (csrc/tls_swap.cpp).

Each isolation test runs twice: with the swap (the state stays isolated) and with the swap switched
off on the engine (the leak is observed), which proves the test would catch a missing swap.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import asyncpp
from asyncpp.kernel.interleaver import Interleaver
from asyncpp.native.tls import load


def torch_state() -> dict:
    return {
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "modes": len(torch.overrides._get_current_function_mode_stack()),
        "dispatch_modes": len(_get_current_dispatch_mode_stack()),
        "autocast_dtype": torch.get_autocast_dtype("cpu"),
        "python_dispatcher": torch._C._dispatch_tls_is_dispatch_key_included(
            torch._C.DispatchKey.PythonDispatcher
        ),
    }


# the state outside any context, in a forward run with grad on
OUTSIDE = {
    "grad": True,
    "inference": False,
    "autocast": False,
    "modes": 0,
    "dispatch_modes": 0,
    "autocast_dtype": torch.bfloat16,
    "python_dispatcher": False,
}


class Probe(nn.Module):
    """Records the torch state the model's own code runs with."""

    def __init__(self):
        super().__init__()
        self.seen: list[dict] = []

    def forward(self, x):
        self.seen.append(torch_state())
        return x


class ProbeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.p0, self.lin0, self.p1, self.lin1, self.p2 = (
            Probe(),
            nn.Linear(4, 4),
            Probe(),
            nn.Linear(4, 4),
            Probe(),
        )

    def forward(self, x):
        return self.p2(self.lin1(self.p1(self.lin0(self.p0(x)))))


class CountingMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class CountingDispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


CONTEXTS = {
    "no_grad": (torch.no_grad, "grad", False),
    "inference_mode": (torch.inference_mode, "inference", True),
    "autocast": (lambda: torch.autocast("cpu", dtype=torch.bfloat16), "autocast", True),
    "torch_function_mode": (CountingMode, "modes", 1),
    "torch_dispatch_mode": (CountingDispatchMode, "dispatch_modes", 1),
    # autocast off but its dtype changed: a later torch.autocast("cpu") in the model would take it
    "autocast_dtype_only": (
        lambda: torch.autocast("cpu", enabled=False, dtype=torch.float16),
        "autocast_dtype",
        torch.float16,
    ),
    "python_dispatcher": (torch._C._EnablePythonDispatcher, "python_dispatcher", True),
}


@pytest.fixture(params=[True, False], ids=["swap", "no-swap"])
def swap(request):
    return request.param


def _engine(model, swap: bool) -> asyncpp.LocalEngine:
    engine = asyncpp.LocalEngine(model)
    if not swap:
        engine._switch = None  # this engine only: run without the swap to show the leak
    return engine


@pytest.mark.parametrize("ctx", list(CONTEXTS))
def test_state_held_across_awaits_does_not_leak_into_the_model(ctx, swap):
    torch.manual_seed(0)
    model = ProbeNet()
    make, key, inside_value = CONTEXTS[ctx]
    engine = _engine(model, swap)

    async def block(m):
        with make():
            await m.p0.output  # parks inside the context: the model runs p1 meanwhile
            mine = torch_state()  # resumed: the block's own state is back
            await m.p2.output
        return mine

    async def other(m):
        await m.lin1.output  # resumed between the first block's awaits
        return torch_state()

    with asyncpp.trace(engine, grad=True) as t:
        h = t.invoke(torch.randn(2, 4), block)
        o = t.invoke(other)
    outside = OUTSIDE
    assert h.result[key] == inside_value
    if swap:
        assert model.p1.seen[-1] == outside  # the model's own layers never saw the block's state
        assert o.result == outside  # nor did the other block
    else:
        assert model.p1.seen[-1][key] == inside_value  # without the swap the state leaks
    assert torch_state() == outside


def test_state_changing_between_awaits_in_every_way_never_leaks():
    """A block that holds no_grad, then also a mode, then autocast, across awaits: each kind of
    switch (a grad-only entry, a mode pushed during such a run, autocast entered on top of it)
    leaves the model's own state untouched and gives the block its own back."""
    torch.manual_seed(0)
    model = ProbeNet()
    engine = _engine(model, True)

    async def block(m):
        seen = []
        with torch.no_grad():
            await m.p0.output
            seen.append(torch_state())
            with CountingMode():
                await m.lin0.output
                seen.append(torch_state())
            await m.p1.output
            seen.append(torch_state())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                await m.lin1.output
                seen.append(torch_state())
            await m.p2.output
            seen.append(torch_state())
        return seen

    with asyncpp.trace(engine, grad=True) as t:
        h = t.invoke(torch.randn(2, 4), block)
    outside = OUTSIDE
    held = {**OUTSIDE, "grad": False}
    assert h.result == [held, {**held, "modes": 1}, held, {**held, "autocast": True}, held]
    assert model.p1.seen[-1] == outside and model.p2.seen[-1] == outside
    assert torch_state() == outside


def test_torch_function_mode_sees_only_the_blocks_own_ops(swap):
    torch.manual_seed(0)
    model = ProbeNet()
    engine = _engine(model, swap)
    mode = CountingMode()

    async def block(m):
        with mode:
            h = await m.p0.output
            h.sum()  # one op of the block's own
            await m.p2.output
        return None

    with asyncpp.trace(engine, grad=True) as t:
        t.invoke(torch.randn(2, 4), block)
    if swap:
        assert mode.calls == 1
    else:
        assert mode.calls > 1  # the model's linear layers ran under the block's mode


def test_block_starts_with_the_forwards_state():
    torch.manual_seed(0)
    model = ProbeNet()

    async def block(m):
        made = torch.ones(2)
        return torch_state(), made.is_inference()

    for grad in (True, False):
        with asyncpp.trace(model, grad=grad) as t:
            h = t.invoke(torch.randn(2, 4), block)
        assert h.result[0]["grad"] is grad
    with torch.inference_mode():
        with asyncpp.trace(model) as t:  # sync entry: the run inherits the caller's state
            h = t.invoke(torch.randn(2, 4), block)
    state, is_inference = h.result
    assert state["inference"] and is_inference


def test_code_after_a_generation_loop_keeps_its_state(engine):
    async def block(m):
        with torch.inference_mode():
            async for _ in m.steps():
                await m.model.layers[0].output
            after = torch_state()  # resumed at the end of the run, outside the forward
        return after

    with asyncpp.generate(engine, max_new_tokens=3, grad=True) as t:
        h = t.invoke("Hi", block)
    assert h.result["inference"] is True
    assert torch_state()["inference"] is False


def test_block_resumed_on_another_thread_gets_its_state_there():
    ext = load()
    kernel = Interleaver(["", "x"], 1, switch=ext)
    slot = asyncpp.Slot("go")
    seen = {}

    async def block(m):
        with torch.no_grad():
            seen["start_thread"] = threading.current_thread().name
            value = await slot  # parked; resumed at a serve point on another thread
            seen["resume_thread"] = threading.current_thread().name
            seen["grad_after_resume"] = torch.is_grad_enabled()
        seen["grad_after_context"] = torch.is_grad_enabled()
        return value

    with torch.enable_grad():
        kernel.start(block(None), 0)
    assert torch.is_grad_enabled()  # the starting thread got its state back

    def serve_elsewhere():
        seen["thread_grad_before"] = torch.is_grad_enabled()
        with kernel.active():
            slot.set(42)
            kernel.serve()
        seen["thread_grad_after"] = torch.is_grad_enabled()

    t = threading.Thread(target=serve_elsewhere, name="server")
    t.start()
    t.join(30)
    block_ = kernel.blocks[0]
    assert block_.done and block_.result == 42
    assert seen["resume_thread"] == "server" and seen["start_thread"] != "server"
    assert seen["grad_after_resume"] is False  # the block's no_grad travelled with it
    assert seen["grad_after_context"] is True  # and its start state (grad on) is under it
    assert seen["thread_grad_before"] is True and seen["thread_grad_after"] is True


def _run_script(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


SCRIPT = """
    import torch, asyncpp
    from torch import nn
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    seen = []
    model[1].register_forward_pre_hook(lambda mod, args: seen.append(torch.is_grad_enabled()))

    async def block(m):
        with torch.no_grad():
            await m[0].output
            await m[1].output

    with asyncpp.trace(model, grad=True) as t:
        t.invoke(torch.randn(1, 4), block)
    print("model saw grad", seen[0])
"""


def test_env_var_turns_the_swap_off_knowingly():
    on = _run_script(SCRIPT, {})
    off = _run_script(SCRIPT, {"ASYNCPP_NATIVE": "0"})
    assert on.returncode == 0, on.stderr
    assert off.returncode == 0, off.stderr
    assert "model saw grad True" in on.stdout
    assert "model saw grad False" in off.stdout


SWITCHES = ("ASYNCPP_NATIVE", "ASYNCPP_TLS_SWAP")

OFF_CHECK = """
    import sys
    import asyncpp, asyncpp.native
    from torch import nn
    engine = asyncpp.LocalEngine(nn.Linear(2, 2))
    print("enabled", asyncpp.native.enabled())
    print("switch", engine.switch)
    print("loaded", any(name.startswith("asyncpp_native_") for name in sys.modules))
"""


def _run_with_switches(code: str, switches: dict) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with exactly ``switches`` of the two env switches set, and
    every DeprecationWarning shown."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    return subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-c", textwrap.dedent(code)],
        env={**env, **switches},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_asyncpp_native_0_switches_the_extension_off():
    res = _run_with_switches(OFF_CHECK, {"ASYNCPP_NATIVE": "0"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == ["enabled False", "switch None", "loaded False"]
    assert "DeprecationWarning" not in res.stderr


def test_the_old_switch_still_works_with_a_deprecation_warning():
    res = _run_with_switches(OFF_CHECK, {"ASYNCPP_TLS_SWAP": "0"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == ["enabled False", "switch None", "loaded False"]
    assert "DeprecationWarning: ASYNCPP_TLS_SWAP is deprecated: set ASYNCPP_NATIVE instead" in res.stderr
    assert res.stderr.count("ASYNCPP_TLS_SWAP is deprecated") == 1  # once per process


@pytest.mark.parametrize(
    ("switches", "on", "warns"),
    [
        ({}, True, False),
        ({"ASYNCPP_NATIVE": "1"}, True, False),
        ({"ASYNCPP_NATIVE": ""}, True, False),
        ({"ASYNCPP_NATIVE": "0"}, False, False),
        ({"ASYNCPP_NATIVE": "false"}, False, False),
        ({"ASYNCPP_NATIVE": " Off "}, False, False),
        ({"ASYNCPP_NATIVE": "NO"}, False, False),
        ({"ASYNCPP_TLS_SWAP": "0"}, False, True),
        ({"ASYNCPP_TLS_SWAP": "off"}, False, True),
        ({"ASYNCPP_TLS_SWAP": "1"}, True, True),
        ({"ASYNCPP_NATIVE": "1", "ASYNCPP_TLS_SWAP": "0"}, True, False),  # the new name wins
        ({"ASYNCPP_NATIVE": "0", "ASYNCPP_TLS_SWAP": "1"}, False, False),
    ],
)
def test_enabled_reads_the_new_switch_then_the_old_one(monkeypatch, switches, on, warns):
    import warnings

    from asyncpp import native

    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(native, "_warned_old_switch", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.enabled() is on
        assert native.enabled() is on  # (warned once at most)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == (1 if warns else 0), messages
    if warns:
        assert messages[0].startswith("ASYNCPP_TLS_SWAP is deprecated: set ASYNCPP_NATIVE instead")


def test_tls_build_error_is_a_deprecated_alias_of_native_build_error():
    from asyncpp import native
    from asyncpp.native import tls

    assert asyncpp.TLSBuildError is asyncpp.NativeBuildError is native.NativeBuildError
    assert native.TLSBuildError is tls.TLSBuildError is tls.NativeBuildError is asyncpp.NativeBuildError
    assert issubclass(asyncpp.NativeBuildError, asyncpp.AsyncppError)
    assert issubclass(asyncpp.NativeBuildError, RuntimeError)
    assert "NativeBuildError" in asyncpp.__all__ and "TLSBuildError" in asyncpp.__all__
    with pytest.raises(asyncpp.TLSBuildError):  # old except clauses still catch it
        raise asyncpp.NativeBuildError("no compiler")
    try:
        raise asyncpp.NativeBuildError("no compiler")
    except asyncpp.TLSBuildError as err:
        assert type(err).__name__ == "NativeBuildError"


def test_the_build_folder_is_named_by_torch_and_python(monkeypatch, tmp_path):
    from asyncpp import native

    monkeypatch.setenv("ASYNCPP_CACHE", str(tmp_path))
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert native.build_dir() == tmp_path / "ext" / f"torch{torch.__version__}-{py}".replace("+", "_")


def test_failed_build_raises_a_clear_error_at_run_start(tmp_path):
    res = _run_script(
        SCRIPT,
        {"ASYNCPP_CACHE": str(tmp_path), "CXX": "/bin/false", "CC": "/bin/false"},
    )
    assert res.returncode != 0
    assert "NativeBuildError" in res.stderr
    assert "ASYNCPP_NATIVE=0" in res.stderr
    assert "g++" in res.stderr


def test_second_load_does_not_rebuild():
    res = _run_script(
        "import time; t = time.perf_counter(); from asyncpp.native.tls import load; m = load(); print(m.__file__)",
        {"ASYNCPP_BUILD_VERBOSE": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert "Building extension" not in res.stdout + res.stderr
    assert (
        "ninja" not in (res.stdout + res.stderr).lower()
        or "no work to do" in (res.stdout + res.stderr).lower()
    )


def _saved_hooks_tag():
    """The tag of the saved-tensor pack hook in force (None: no hooks)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else getattr(top[0], "tag", "?")


def _tagged_pack(tag: str):
    def pack(t):
        return t

    pack.tag = tag
    return pack


def _unpack(t):
    return t


@pytest.mark.parametrize("outer", [False, True], ids=["bare", "under-hooks"])
def test_context_replaced_at_the_same_depth_between_awaits_is_seen(outer):
    """A block that leaves one context and enters another of the same kind between two awaits (the
    stack is as deep as before, and the new entry may reuse the old one's memory) has the new one
    after the next await, and the model sees neither; also when the run itself is under hooks."""
    torch.manual_seed(0)
    model = ProbeNet()
    engine = _engine(model, True)
    mode_a, mode_b = CountingMode(), CountingMode()

    async def block(m):
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(_tagged_pack("first"), _unpack):
            await m.p0.output
            seen.append(_saved_hooks_tag())
        with torch.autograd.graph.saved_tensors_hooks(_tagged_pack("second"), _unpack):
            await m.lin0.output
            seen.append(_saved_hooks_tag())
        with mode_a:
            await m.p1.output
            torch.zeros(1).sum()
        with mode_b:
            await m.lin1.output
            torch.zeros(1).sum()
        return seen

    outside = contextlib.nullcontext()
    if outer:
        outside = torch.autograd.graph.saved_tensors_hooks(_tagged_pack("outer"), _unpack)
    with outside:
        with asyncpp.trace(engine, grad=True) as t:
            h = t.invoke(torch.randn(2, 4), block)
        assert _saved_hooks_tag() == ("outer" if outer else None)
    assert h.result == ["first", "second"]
    assert (mode_a.calls, mode_b.calls) == (2, 2)  # each saw the block's own ops after its await


def test_autocast_fields_in_place_and_the_fallback_both_isolate():
    """The swap reads and sets autocast's fields in place where it can locate them in torch (here it
    can); where it cannot, it goes through torch's getters and setters. The isolation tests that
    involve autocast pass both ways (the second forced with ASYNCPP_AUTOCAST_GETTERS=1)."""
    assert load().autocast_in_place()
    forced = _run_script(
        "from asyncpp.native import load; print(load().autocast_in_place())",
        {"ASYNCPP_AUTOCAST_GETTERS": "1"},
    )
    assert forced.returncode == 0 and forced.stdout.strip() == "False", forced.stderr[-2000:]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "(autocast and swap and not fallback) or changing_between or same_depth or starts_with",
        ],
        env={**os.environ, "ASYNCPP_AUTOCAST_GETTERS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and "failed" not in res.stdout


def test_state_made_on_a_thread_that_ended_works_on_a_new_thread():
    """A block state made on a thread that has ended, used on a new thread (which may get the old
    one's id: glibc reuses its stack) reads and sets the new thread's torch state."""
    switch = load()
    made: list = []
    first = threading.Thread(target=lambda: made.append(switch.BlockState()))
    first.start()
    first.join()
    template = made[0]
    seen: dict = {}

    def second():
        with torch.no_grad():
            state = template.fork()
            switch.enter(state)  # the block starts with this thread's state: grad off
            seen["start"] = torch.is_grad_enabled()
            torch.set_grad_enabled(True)  # the block turns grad on
            switch.leave(state)
            seen["after leave"] = torch.is_grad_enabled()
            switch.enter(state)
            seen["entered again"] = torch.is_grad_enabled()
            switch.leave(state)
            seen["end"] = torch.is_grad_enabled()

    t = threading.Thread(target=second)
    t.start()
    t.join()
    assert seen["start"] is False and seen["after leave"] is False
    assert seen["entered again"] is True and seen["end"] is False


def test_asyncpp_tls_is_a_deprecated_alias_of_native_tls():
    import importlib
    import sys

    from asyncpp.native import tls

    with pytest.warns(DeprecationWarning, match="asyncpp.native.tls"):
        if "asyncpp.tls" in sys.modules:
            importlib.reload(sys.modules["asyncpp.tls"])
        else:
            importlib.import_module("asyncpp.tls")
    old = sys.modules["asyncpp.tls"]
    assert old.get_switch is tls.get_switch and old.TLSBuildError is tls.TLSBuildError
