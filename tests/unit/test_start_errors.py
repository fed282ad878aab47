"""asyncpp's errors in vLLM's processes while an engine starts: found in the chain of what the
process raised (dynamo's stand-in included, as a tap's check fails while the model is traced),
written by a spawned process into the starting engine's folder, and rebuilt as their own class."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from asyncpp.engines.vllm import start_errors, taps
from asyncpp.kernel.errors import AsyncppError, TapError

_GATE = torch.nn.ReLU()  # (a module argument: no inputs tap carries it)


def _traced_tap_failure() -> BaseException:
    forward = taps.tapped_forward(lambda x, gate: gate(x), 7, "model.layers.0", output=False, inputs=True)
    compiled = torch.compile(lambda x: forward(x, gate=_GATE), fullgraph=True, backend="eager")
    try:
        compiled(torch.ones(2))
    except BaseException as err:
        return err
    raise AssertionError("the tap's check did not fail")


def test_a_tap_error_raised_while_dynamo_traces_is_found_with_its_message():
    err = _traced_tap_failure()
    assert not isinstance(err, TapError)  # dynamo's error, with its own stand-in as the cause
    with pytest.raises(TapError) as direct:
        taps.flatten_args((torch.ones(2),), {"gate": _GATE}, "model.layers.0", ("x", "gate"))
    assert start_errors.asyncpp_error_in(err) == ("TapError", str(direct.value))


def test_other_errors_are_not_asyncpps():
    try:
        try:
            raise KeyError("x")
        except KeyError as inner:
            raise RuntimeError("engine core failed") from inner
    except RuntimeError as err:
        assert start_errors.asyncpp_error_in(err) is None
    wrapped = RuntimeError("worker failed")
    wrapped.__cause__ = TapError("a.b cannot be a tap")
    assert start_errors.asyncpp_error_in(wrapped) == ("TapError", "a.b cannot be a tap")


def _child_reports(message: str) -> None:
    try:
        raise RuntimeError("vLLM's wrapper") from TapError(message)
    except RuntimeError as err:
        start_errors.report(err)


def _child_fails_plainly() -> None:
    start_errors.report(ValueError("not ours"))


def test_a_spawned_process_reports_into_the_starting_engines_folder():
    ctx = multiprocessing.get_context("spawn")
    with start_errors.collecting() as first:
        folder = os.environ[start_errors.ENV]
        child = ctx.Process(target=_child_fails_plainly)
        child.start()
        child.join(60)
        assert child.exitcode == 0 and first() is None
        child = ctx.Process(target=_child_reports, args=("model.x cannot be a tap",))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        err = first()
        assert type(err) is TapError and isinstance(err, AsyncppError)
        assert str(err) == "model.x cannot be a tap"
    assert start_errors.ENV not in os.environ and not os.path.exists(folder)  # restored, removed
