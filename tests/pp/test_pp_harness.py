"""Pipeline parallel, harness tier: two spawned gloo ranks, each a stage with its own interleaver,
stage session and pull service, running the same block; no vLLM. "The model reached this location"
is a direct ``visit_output`` call on the stage that owns it. Checks lazy remote values, pulls in
place and at serve points, the publish hook, errors delivered into the block, merged results, and
that unused remote reads move no bytes. Hard timeouts kill hung ranks (see test_pp_transport)."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from test_pp_transport import _run

import asyncpp
from asyncpp.kernel.hooks import RunHooks
from asyncpp.kernel.interleaver import Interleaver
from asyncpp.locations.tree import tree_from_paths
from asyncpp.pp.merge import merge
from asyncpp.pp.ownership import LOCAL, Ownership
from asyncpp.pp.stage import StageSession

ENTRIES = [("", "Model"), ("a", "Linear"), ("b", "Linear")]  # a: stage 0, b: stage 1
A, B = torch.arange(6.0).reshape(2, 3), torch.full((2, 3), 7.0)


def _stage(svc: Any, rank: int) -> tuple[Interleaver, StageSession, Any]:
    own = Ownership(ENTRIES, [LOCAL, 0, 1], 2)
    session = StageSession(own, rank, svc, lambda block: 5)
    kernel = Interleaver(own.paths, 2, hooks=RunHooks(**session.hooks()))
    session.attach(kernel)
    return kernel, session, tree_from_paths(ENTRIES)


async def uses_both(m):
    a = await m.a.output  # stage 1: a remote value (stage 0 owns a), no traffic yet
    b = await m.b.output  # stage 0: a remote value, downstream
    b2 = await asyncpp.pull(b * 2)  # stage 0 waits for stage 1 at a serve point
    return {"a": a + 1, "b2": b2}


async def reads_only(m):
    await m.a.output
    await m.b.output
    return "done"


async def catches(m):
    b = await m.b.output
    try:
        return float(await asyncpp.pull(b.sum()))
    except asyncpp.PullError as err:
        return f"caught: {err}"


def _scenario(block: Any, fail_b: bool = False) -> Any:
    return functools.partial(_stage_run, block, fail_b)


def _stage_run(block: Any, fail_b: bool, svc: Any, rank: int, world: int) -> dict[str, Any]:
    if True:
        kernel, session, m = _stage(svc, rank)
        with kernel.active():
            blk = kernel.start(block(m), 0, None)
            if rank == 0:
                kernel.visit_output(1, A.clone())  # the model reaches a
            elif fail_b == "release":  # the model never reaches b; the request just ends here
                pass
            elif fail_b:  # the model never reaches b here; the owner fails its pulls instead
                svc.fail(5, 2 * 4 + 2, 0, "stage 1 could not produce b")
            else:
                kernel.visit_output(2, B.clone())  # the model reaches b
            parked = len(session.parked)
            session.serve()  # the serve point after the forward
            kernel.finish_blocks([blk])
            result = session.result(blk.result) if blk.error is None else repr(blk.error)
        svc.release(5)
        end = time.monotonic() + 10  # the buffer goes when the peer's release arrives
        while any(svc.held().values()) and time.monotonic() < end:
            time.sleep(0.01)
        # plain data only through the queue (tensors would travel as shared memory the exiting
        # child takes with it)
        return {
            "result": _plain(result),
            "parked": parked,
            "stats": dict(svc.stats),
            "held": svc.held(),
        }


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _tensor(value: Any) -> torch.Tensor:
    assert value[0] == "tensor", value
    return torch.tensor(value[1])


def test_lazy_values_pulls_and_serve_points(tmp_path):
    r0, r1 = _run(_scenario(uses_both), 2, tmp_path)
    assert r0["parked"] == 1 and r1["parked"] == 0  # only the upstream stage waited
    merged = merge([r0["result"], r1["result"]])
    assert torch.equal(_tensor(merged["a"]), A + 1) and torch.equal(_tensor(merged["b2"]), B * 2)
    # stage 0 pulled b; stage 1 left a + 1 to stage 0, which computes it from its own a
    assert r0["stats"]["pulls"] == 1 and r1["stats"]["pulls"] == 0
    assert r1["result"]["a"] is asyncpp.NOT_HERE
    for r in (r0, r1):
        assert all(v == 0 for v in r["held"].values()), r["held"]  # released: nothing kept


def test_unused_remote_reads_move_no_bytes(tmp_path):
    r0, r1 = _run(_scenario(reads_only), 2, tmp_path)
    assert r0["result"] == r1["result"] == "done"
    for r in (r0, r1):
        assert r["stats"]["pulls"] == 0 and r["stats"]["bytes_in"] == 0 and r["stats"]["bytes_out"] == 0


def test_a_failed_pull_is_raised_at_the_line_that_forced_it(tmp_path):
    r0, r1 = _run(_scenario(catches, fail_b=True), 2, tmp_path)
    assert r0["result"].startswith("caught:") and "could not produce b" in r0["result"]
    assert "NeverReachedError" in r1["result"]  # the owner's own wait for b ends at the run's end


def test_a_pull_waiting_for_a_value_its_owner_will_never_produce_fails_at_release(tmp_path):
    """The owner's request ends without reaching b: the waiting pull is answered at once, not at
    the deadline (20 s here)."""
    r0, r1 = _run(_scenario(catches, fail_b="release"), 2, tmp_path)
    assert r0["result"].startswith("caught:") and "ended on stage 1" in r0["result"], r0["result"]
    assert "timed out" not in r0["result"]  # answered by the release, not by the deadline


# --- serve points: non-blocking (inside the forward) and blocking (outside it) ----------------------


async def pulls_b(m):
    b = await m.b.output  # stage 0: a remote value, downstream
    return await asyncpp.pull(b * 2)  # stage 0 parks; its pull is sent to stage 1 at once


def _until(check: Any, what: str, seconds: float = 30.0) -> None:
    """Wait for another rank (a synchronisation with a hard limit, not a timing check)."""
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.01)


def _serve_points_run(case: str, flag: Any, svc: Any, rank: int, world: int) -> dict[str, Any]:
    """case "produced": stage 1 produces b before stage 0's non-blocking serve point; "late": only
    after it; "forgotten": stage 0 forgets the block while its pull is in flight."""
    kernel, session, m = _stage(svc, rank)
    out: dict[str, Any] = {}
    with kernel.active():
        blk = kernel.start(pulls_b(m), 0, None)
        if rank == 1:
            if case != "produced":
                _until(flag.exists, "stage 0's serve point")
            if case == "forgotten":
                _until(lambda: svc.stats["cancels"] == 1, "the cancel")
            kernel.visit_output(2, B.clone())  # the model reaches b
        else:
            out["parked"] = len(session.parked)
            if case == "produced":
                _until(lambda: all(h.answered() for _, h in session.parked[0].handles), "the reply")
            if case == "forgotten":
                session.forget(blk)
            session.poll()  # the non-blocking serve point
            out["after_poll"] = (len(session.parked), blk.done)
            flag.write_text(case)
            session.serve()  # the blocking serve point
            out["after_serve"] = (len(session.parked), blk.done)
        if case == "forgotten" and rank == 0:
            kernel.forget(blk)
            result = "forgotten"
        else:
            kernel.finish_blocks([blk])
            result = session.result(blk.result) if blk.error is None else repr(blk.error)
    svc.release(5)
    end = time.monotonic() + 10
    while any(svc.held().values()) and time.monotonic() < end:
        time.sleep(0.01)
    return {**out, "result": _plain(result), "stats": dict(svc.stats), "held": svc.held()}


def _serve_points(case: str, tmp_path: Any) -> list[dict[str, Any]]:
    return _run(functools.partial(_serve_points_run, case, tmp_path / "flag"), 2, tmp_path)


def test_a_parked_pull_whose_value_was_produced_resumes_at_the_non_blocking_point(tmp_path):
    r0, r1 = _serve_points("produced", tmp_path)
    assert r0["parked"] == 1
    assert r0["after_poll"] == (0, True)  # resumed inside the forward, not at the next step
    assert torch.equal(_tensor(r0["result"]), B * 2) and torch.equal(_tensor(r1["result"]), B * 2)
    assert r0["stats"]["pulls"] == 1
    for r in (r0, r1):
        assert all(v == 0 for v in r["held"].values()), r["held"]


def test_a_parked_pull_whose_value_is_not_produced_waits_for_the_blocking_point(tmp_path):
    r0, r1 = _serve_points("late", tmp_path)
    assert r0["after_poll"] == (1, False)  # not answered yet: still parked, the forward goes on
    assert r0["after_serve"] == (0, True)  # the blocking point waited for stage 1
    assert torch.equal(_tensor(r0["result"]), B * 2)
    assert r0["stats"]["pulls"] == 1
    for r in (r0, r1):
        assert all(v == 0 for v in r["held"].values()), r["held"]


def test_a_forgotten_blocks_pull_in_flight_is_cancelled_at_its_owner(tmp_path):
    r0, r1 = _serve_points("forgotten", tmp_path)
    assert r0["after_poll"] == r0["after_serve"] == (0, False)
    assert r1["stats"]["cancels"] == 1  # the owner dropped the waiting pull, answered nobody
    assert r1["stats"]["served"] == 0
    for r in (r0, r1):
        assert all(v == 0 for v in r["held"].values()), r["held"]
