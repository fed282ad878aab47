"""The cross-stage pull service (asyncpp.pp.pulls) on real spawned gloo ranks (no mocks).

Each test spawns 2 or 3 processes that join a gloo group through a file rendezvous and run one scenario
with a PullService each; a "fake model reached this location" is a direct publish().  Children report
plain Python data through a Queue; the parent asserts.  Every run has a hard timeout that kills hung
children, so a deadlock fails fast instead of hanging the suite.  What only these tests do to a
service (read its buffer, clear a request, a blocking drain) is in pull_helpers.  The wire format
alone is tested in one process by test_pull_format.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pull_helpers as ph
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncpp.pp import pull_format as fmt
from asyncpp.pp.pulls import PullError, PullService, PullTimeout

HARD_TIMEOUT_S = 60.0
HDR = 96  # bytes of one protocol header (12 int64 words): the wire format must not change

Scenario = Callable[[PullService, int, int], dict[str, Any]]


# ---------------------------------------------------------------------------------------------- harness


def _child(
    rank: int, world: int, init_file: str, scenario: Scenario, deadline_s: float, results: Any, wire: str
) -> None:
    """One rank: join the gloo group, run the scenario with a started PullService, report, tear down."""
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=HARD_TIMEOUT_S),
        )
        group = dist.new_group(backend="gloo")
        svc = PullService(group, rank, world, deadline_s=deadline_s, wire=wire)
        svc.start()
        out = scenario(svc, rank, world)
        svc.close()
        out["final_stats"] = dict(svc.stats)
        dist.destroy_process_group()
    except BaseException:
        # report at once; no graceful teardown (the peers may be stuck): the parent kills what hangs
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ok", out))


def _run(
    scenario: Scenario,
    world: int,
    tmp_path: Path,
    *,
    deadline_s: float = 20.0,
    wire: str = "tcp",
    may_die: frozenset[int] = frozenset(),
) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks running ``scenario`` on ``wire``; return each rank's report (None for
    a rank of ``may_die`` that died without one).  Kills everything and fails if any rank is not done
    within HARD_TIMEOUT_S."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = str(tmp_path / "gloo_init")
    procs = [
        ctx.Process(
            target=_child, args=(r, world, init_file, scenario, deadline_s, results, wire), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    end = time.monotonic() + HARD_TIMEOUT_S
    hung: list[int] = []
    died: list[str] = []
    try:
        while len(got) < world - len(may_die) and time.monotonic() < end:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if i not in got and i not in may_die and p.exitcode not in (None, 0)
                ]
                if dead:
                    # give a dying rank's report a moment to arrive, then stop waiting
                    try:
                        rank, status, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        died = [f"rank {i} exited with code {procs[i].exitcode}" for i in dead]
                        break
                else:
                    continue
            got[rank] = (status, payload)
            if status != "ok":
                end = min(end, time.monotonic() + 5.0)  # one rank failed: the others may never finish
        for p in procs:
            p.join(max(0.1, min(10.0, end - time.monotonic())))
    finally:
        for i, p in enumerate(procs):
            if p.is_alive():
                hung.append(i)
                p.kill()
        while True:  # reports that came while the others were joined
            try:
                rank, status, payload = results.get_nowait()
            except queue.Empty:
                break
            got[rank] = (status, payload)
        for p in procs:
            p.join(5)
            p.close()
        results.close()
        results.join_thread()
    errors = [f"rank {r}:\n{payload}" for r, (status, payload) in sorted(got.items()) if status != "ok"]
    assert not errors, "\n".join(errors)
    assert not died, died
    assert not hung, (
        f"ranks {hung} hung past {HARD_TIMEOUT_S} s and were killed (missing reports: {world - len(got)})"
    )
    missing = set(range(world)) - set(got) - may_die
    assert not missing, f"only ranks {sorted(got)} reported"
    return [got[r][1] if r in got else None for r in range(world)]


def _describe(v: Any) -> Any:
    """A picklable description of a value's structure, dtypes and shapes."""
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), list(v.shape))
    return (type(v).__name__, [_describe(x) for x in v])


def _nbytes(v: Any) -> int:
    """Payload bytes of a tensor or a nested tuple/list of tensors."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    return sum(_nbytes(x) for x in v)


def _plain(v: Any) -> Any:
    """A value with its tensors as (dtype, list) pairs: plain Python, to send back to the test."""
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), v.tolist())
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return type(v)(_plain(x) for x in v)
    return v


def _catch(fn: Callable[[], Any]) -> tuple[str, str]:
    """Run a pull expected to fail: (exception class name, message)."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


# ---------------------------------------------------------------------------------------------- values

BIG = 1 << 18  # float32 elements: a 1 MiB payload


def _values() -> dict[int, Any]:
    """The values stage 0 publishes in the round-trip scenario, by key (deterministic on every rank)."""
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(4, 6, generator=g)
    return {
        1: torch.randn(3, 4, generator=g),
        2: torch.randn(2, 5, generator=g).to(torch.bfloat16),
        3: torch.arange(7, dtype=torch.int64) + (1 << 40),
        4: torch.rand(3, 3, generator=g) > 0.5,
        5: (torch.randn(2, 3, generator=g), torch.randn(4, generator=g)),
        6: [torch.tensor([1, -2]), (torch.tensor([[3, 4]]), torch.tensor(5))],
        7: base.t(),  # non-contiguous
        8: torch.empty(0, 4, dtype=torch.float16),
        9: (torch.randn(2, 2, generator=g).to(torch.bfloat16),) * 2,
        10: (),
        11: torch.tensor(2.5),  # 0-dim
        12: torch.randn(BIG, generator=g),
    }


def _scenario_roundtrip(svc: PullService, rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # --- a run with no pulls: values published and drained, nothing pulled -> zero pull bytes
    svc.publish(1, 1, 0, torch.ones(8))
    svc.publish(1, 2, 0, (torch.ones(2), torch.zeros(3)))
    ph.drain(svc, 1)
    out["quiet_stats"] = dict(svc.stats)
    out["quiet_has_after_drain"] = ph.has(svc, 1, 1, 0)

    # --- values published before the pull arrives
    values = _values()
    if rank == 0:
        for key, value in values.items():
            svc.publish(2, key, 0, value)
        svc.publish(2, 1, 1, torch.full((2,), 7.0))  # same key, other visit
        mutated = torch.arange(5.0)
        svc.publish(2, 13, 0, mutated)
        mutated.add_(100)  # the owner keeps a private copy: pulls must not see this
    else:
        svc.publish(2, 20, 0, torch.tensor([[True, False]]))
    dist.barrier()
    if rank == 1:
        stats0 = dict(svc.stats)
        got = {key: svc.pull(0, 2, key, 0, where=f"model.layers.{key}.output") for key in values}
        out["same"] = {key: ph.same_value(got[key], values[key]) for key in values}
        out["described"] = {key: _describe(got[key]) for key in values}
        out["contiguous"] = got[7].is_contiguous()
        out["int64_values"] = got[3].tolist()
        out["other_visit"] = svc.pull(0, 2, 1, 1, where="model.layers.1.output").tolist()
        out["private_copy"] = svc.pull(0, 2, 13, 0, where="x").tolist()
        n_pulls = len(values) + 2
        stats1 = dict(svc.stats)
        out["pull_delta"] = stats1["pulls"] - stats0["pulls"]
        out["bytes_in_delta"] = stats1["bytes_in"] - stats0["bytes_in"]
        out["bytes_out_delta"] = stats1["bytes_out"] - stats0["bytes_out"]
        out["n_pulls"] = n_pulls
        out["payload_bytes"] = sum(_nbytes(v) for v in values.values())
    dist.barrier()
    if rank == 0:
        pulled = svc.pull(1, 2, 20, 0, where="model.layers.20.output")
        out["from_1"] = (str(pulled.dtype), pulled.tolist())
        out["has"] = ph.has(svc, 2, 1, 0)
        out["has_missing"] = ph.has(svc, 2, 99, 0)
        first = ph.local(svc, 2, 5, 0)
        first[0].add_(1)  # local reads hand out a copy too
        out["local_same"] = ph.same_value(ph.local(svc, 2, 5, 0), values[5])
        out["self_pull_same"] = ph.same_value(svc.pull(0, 2, 2, 0, where="self"), values[2])
    ph.drain(svc, 2)
    out["has_after_drain"] = ph.has(svc, 2, 1, 0)
    dist.barrier()
    out["stats"] = dict(svc.stats)
    return out


def test_roundtrip_values_dtypes_containers_and_counters(tmp_path: Path) -> None:
    r0, r1 = _run(_scenario_roundtrip, 2, tmp_path)

    # a run with no pulls moves zero pull bytes (only the drain's control messages)
    for r in (r0, r1):
        q = r["quiet_stats"]
        assert q["pulls"] == q["served"] == q["bytes_in"] == q["bytes_out"] == 0, q
        assert q["ctrl_bytes_out"] == HDR and q["ctrl_bytes_in"] == HDR, q
        assert r["quiet_has_after_drain"] is False

    assert all(r1["same"].values()), r1["same"]
    assert r1["described"][1] == ("torch.float32", [3, 4])
    assert r1["described"][2] == ("torch.bfloat16", [2, 5])
    assert r1["described"][3] == ("torch.int64", [7])
    assert r1["described"][4] == ("torch.bool", [3, 3])
    assert r1["described"][5] == ("tuple", [("torch.float32", [2, 3]), ("torch.float32", [4])])
    assert r1["described"][6] == (
        "list",
        [("torch.int64", [2]), ("tuple", [("torch.int64", [1, 2]), ("torch.int64", [])])],
    )
    assert r1["described"][7] == ("torch.float32", [6, 4])
    assert r1["described"][8] == ("torch.float16", [0, 4])
    assert r1["described"][9] == ("tuple", [("torch.bfloat16", [2, 2])] * 2)
    assert r1["described"][10] == ("tuple", [])
    assert r1["described"][11] == ("torch.float32", [])
    assert r1["contiguous"] is True
    assert r1["int64_values"] == [(1 << 40) + i for i in range(7)]
    assert r1["other_visit"] == [7.0, 7.0]
    assert r1["private_copy"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert r0["from_1"] == ("torch.bool", [[True, False]])
    assert r0["has"] is True and r0["has_missing"] is False
    assert r0["local_same"] is True and r0["self_pull_same"] is True
    assert r0["has_after_drain"] is False and r1["has_after_drain"] is False

    # counters count real traffic: one request header per pull, one reply header + body per answer
    n = r1["n_pulls"]
    assert r1["pull_delta"] == n
    assert r1["bytes_out_delta"] == n * HDR
    payload = r1["payload_bytes"]
    assert payload >= BIG * 4
    assert payload + n * HDR <= r1["bytes_in_delta"] <= payload + n * HDR + 4096
    s0, s1 = r0["final_stats"], r1["final_stats"]
    assert s1["pulls"] == n and s0["pulls"] == 1
    assert s0["served"] == n and s1["served"] == 1
    assert s0["served_errors"] == s1["served_errors"] == 0
    assert s0["bytes_out"] == s1["bytes_in"] and s1["bytes_out"] == s0["bytes_in"]
    assert s0["local_pulls"] == 1
    assert r0["stats"]["ctrl_bytes_out"] == r1["stats"]["ctrl_bytes_out"] == 2 * HDR  # two drains
    # close() adds only the goodbye
    assert s0["ctrl_bytes_out"] == s0["ctrl_bytes_in"] == s1["ctrl_bytes_out"] == 3 * HDR


# ---------------------------------------------------------------------------------------------- waiting, errors


def _later(
    delay: float, fn: Callable[[], Any], at: dict[str, float] | None = None, name: str = ""
) -> threading.Thread:
    """Run fn after ``delay`` seconds on another thread (the owner's model reaching a location later);
    ``at[name]`` records when it began (time.monotonic is one clock for every process here), so
    tests compare the order of events rather than durations."""

    def go() -> None:
        time.sleep(delay)
        if at is not None:
            at[name] = time.monotonic()
        fn()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _scenario_waiting_and_errors(svc: PullService, rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"at": {}}
    at = out["at"]
    req = 5
    dist.barrier()
    if rank == 0:
        # the owner reaches its locations only after the pulls were sent
        _later(0.8, lambda: svc.publish(req, 1, 0, torch.arange(6, dtype=torch.int64).view(2, 3)), at, "pub1")
        svc.fail(req, 2, 0, "boom: layer 3 raised ValueError")
        _later(0.5, lambda: svc.fail(req, 3, 0, "late boom"))
        svc.publish(req, 4, 0, (torch.ones(2), torch.ones(2, dtype=torch.int64), torch.zeros(1)))
        svc.publish(req, 5, 0, ((torch.ones(2), None), {"use_cache": True, "scale": 0.5}))
        svc.publish(req, 6, 0, [torch.ones(1), [torch.ones(1), {1: torch.ones(1)}]])
        out["local_mixed"] = _plain(ph.local(svc, req, 4, 0))
        # an owner pulling from itself waits for its own publish (another thread reaches it)
        _later(0.3, lambda: svc.publish(req, 7, 0, torch.tensor([1.5])), at, "pub7")
        out["self_wait"] = (svc.pull(0, req, 7, 0, where="self").tolist(), time.monotonic())
        dist.barrier()  # 1: stage 1 done with the above
        dist.barrier()  # 2: stage 1's pull of key 9 timed out
        time.sleep(0.3)  # let the cancel arrive
        served = svc.stats["served"] + svc.stats["served_errors"]
        out["cancels"] = svc.stats["cancels"]
        svc.publish(req, 9, 0, torch.ones(3))  # nobody waits for it any more: nothing is sent
        time.sleep(0.3)
        out["sent_after_cancel"] = svc.stats["served"] + svc.stats["served_errors"] - served
        # clearing answers a pull waiting for a value of the request with an error
        dist.barrier()  # 3
        _later(0.4, lambda: ph.clear(svc, 6), at, "clear6")
        dist.barrier()  # 4: stage 1 saw it
        dist.barrier()  # 5: stage 1 has a pull waiting here that nobody will answer; close answers it
    else:
        v = svc.pull(0, req, 1, 0, where="model.layers.1.output")
        out["waited"] = (v.tolist(), str(v.dtype), time.monotonic())
        out["failed"] = _catch(lambda: svc.pull(0, req, 2, 0, where="model.layers.2.output"))
        out["failed_later"] = _catch(lambda: svc.pull(0, req, 3, 0, where="model.layers.3.mlp.output"))
        out["mixed"] = _plain(svc.pull(0, req, 4, 0, where="model.layers.4.output"))
        out["call"] = _plain(svc.pull(0, req, 5, 0, where="model.layers.5.inputs"))
        out["int_key"] = _catch(lambda: svc.pull(0, req, 6, 0, where="model.layers.6.output"))
        out["bad_owner"] = _catch(lambda: svc.pull(7, req, 1, 0, where="model.norm.output"))
        dist.barrier()  # 1
        out["timeout"] = _catch(lambda: svc.pull(0, req, 9, 0, where="model.layers.9.output"))
        dist.barrier()  # 2
        dist.barrier()  # 3
        out["cleared"] = _catch(lambda: svc.pull(0, 6, 1, 0, where="model.layers.0.output"))
        out["cleared_at"] = time.monotonic()
        out["after_clear"] = _catch(lambda: svc.pull(0, 6, 2, 0, where="model.layers.1.output"))
        out["late_replies"] = svc.stats["late_replies"]
        dist.barrier()  # 4
        pending: dict[str, Any] = {}

        def waiting_pull() -> None:
            pending["result"] = _catch(lambda: svc.pull(0, 8, 1, 0, where="model.layers.8.output"))

        waiter = threading.Thread(target=waiting_pull, daemon=True)
        waiter.start()
        time.sleep(0.3)
        dist.barrier()  # 5
        svc.close()  # our own pending pull raises PullError
        waiter.join(10)
        out["closed_pending"] = pending.get("result", ("still waiting", ""))
        out["after_close"] = _catch(lambda: svc.pull(0, 8, 1, 0, where="model.layers.8.output"))
    return out


def test_waiting_pulls_errors_timeout_clear_and_close(tmp_path: Path) -> None:
    r0, r1 = _run(_scenario_waiting_and_errors, 2, tmp_path, deadline_s=3.0)

    value, dtype, answered = r1["waited"]
    assert value == [[0, 1, 2], [3, 4, 5]] and dtype == "torch.int64"
    assert answered >= r0["at"]["pub1"], "the pull was answered before the owner published"

    kind, msg = r1["failed"]
    assert kind == "PullError" and "boom: layer 3 raised ValueError" in msg
    assert "model.layers.2.output" in msg and "stage 0" in msg
    kind, msg = r1["failed_later"]
    assert kind == "PullError" and "late boom" in msg and "model.layers.3.mlp.output" in msg

    mixed = (("torch.float32", [1.0, 1.0]), ("torch.int64", [1, 1]), ("torch.float32", [0.0]))
    assert r1["mixed"] == mixed and r0["local_mixed"] == mixed  # each tensor its own dtype
    assert r1["call"] == ((("torch.float32", [1.0, 1.0]), None), {"use_cache": True, "scale": 0.5})
    kind, msg = r1["int_key"]
    assert kind == "PullError" and "value[1][1] is a dict with a int key" in msg, msg
    kind, msg = r1["bad_owner"]
    assert kind == "PullError" and "stage 7" in msg

    assert r0["self_wait"][0] == [1.5] and r0["self_wait"][1] >= r0["at"]["pub7"]

    kind, msg = r1["timeout"]
    assert kind == "PullTimeout", (kind, msg)
    assert "model.layers.9.output" in msg and "stage 0" in msg and "timed out after 3." in msg
    assert r0["cancels"] == 1 and r0["sent_after_cancel"] == 0

    kind, msg = r1["cleared"]
    assert kind == "PullError" and "request 6 ended" in msg and "before" in msg and "produced" in msg
    assert r1["cleared_at"] >= r0["at"]["clear6"]  # answered by the clear, not before it
    kind, msg = r1["after_clear"]
    assert kind == "PullError" and "request 6 ended" in msg

    kind, msg = r1["closed_pending"]
    assert kind == "PullError" and "closed" in msg and "model.layers.8.output" in msg
    kind, msg = r1["after_close"]
    assert kind == "PullError" and "closed" in msg
    assert r1["late_replies"] == 0
    assert issubclass(PullTimeout, PullError)


# ---------------------------------------------------------------------------------------------- drain, concurrency


def _scenario_drain_and_concurrency(svc: PullService, rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"drain_called": {}, "drain_returned": {}, "values_ok": [], "has_after": []}
    # several requests, every rank pulling from every other (often before the owner published),
    # then draining them in the same order; stage 2 is slow to drain request 102
    for req in range(100, 105):
        if rank == 2 and req == 101:
            time.sleep(0.3)  # publish late: the others' pulls wait at the owner
        svc.publish(req, rank, 0, torch.full((3,), float(req * 10 + rank)))
        ok = True
        for owner in range(world):
            if owner != rank:
                v = svc.pull(owner, req, owner, 0, where=f"model.layers.{owner}.output")
                ok = ok and v.tolist() == [float(req * 10 + owner)] * 3
        out["values_ok"].append(ok)
        if rank == 2 and req == 102:
            time.sleep(1.0)
        out["drain_called"][req] = time.monotonic()
        ph.drain(svc, req)
        out["drain_returned"][req] = time.monotonic()
        out["has_after"].append(ph.has(svc, req, rank, 0))

    # concurrent pulls: stage 0 pulls from two threads at once (from both owners, same keys too) while
    # stages 1 and 2 pull from each other and from stage 0 -- many requesters, outstanding at once
    req, n = 200, 12
    dist.barrier()
    publisher = None
    if rank != 0:
        publisher = _later(
            0.2, lambda: [svc.publish(req, k, rank, torch.arange(k + 1) * rank) for k in range(n)]
        )
    else:
        svc.publish(req, 0, 0, torch.ones(2, dtype=torch.bfloat16))
    results: dict[str, bool] = {}
    errors: list[str] = []

    def worker(name: str, plan: list[tuple[int, int]]) -> None:
        try:
            good = True
            for owner, k in plan:
                if owner == 0:
                    v = svc.pull(0, req, 0, 0, where="model.embed.output")
                    good = good and v.dtype == torch.bfloat16 and v.tolist() == [1.0, 1.0]
                else:
                    v = svc.pull(owner, req, k, owner, where=f"model.layers.{k}.output")
                    good = good and v.tolist() == (torch.arange(k + 1) * owner).tolist()
            results[name] = good
        except Exception:
            errors.append(traceback.format_exc())

    if rank == 0:
        plans = {
            "a": [(1 + k % 2, k) for k in range(n)],
            "b": [(2 - k % 2, k) for k in reversed(range(n))],
        }
    else:
        other = 3 - rank
        plans = {"a": [(other, k) for k in range(n)], "b": [(0, 0)] * 3 + [(other, k) for k in range(n)]}
    threads = [threading.Thread(target=worker, args=(name, plan)) for name, plan in plans.items()]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    out["concurrent_s"] = time.monotonic() - t0
    out["concurrent"] = results
    out["concurrent_errors"] = errors
    out["pulls_expected"] = 5 * (world - 1) + sum(len(p) for p in plans.values())
    if publisher is not None:  # a stage publishes all it produces before its request ends (on a
        publisher.join(30)  # loaded machine the publishing thread may still be at it here)
    ph.drain(svc, req)
    dist.barrier()
    out["stats"] = dict(svc.stats)
    return out


def test_drain_three_ranks_and_concurrent_pulls(tmp_path: Path) -> None:
    reports = _run(_scenario_drain_and_concurrency, 3, tmp_path)
    for rank, r in enumerate(reports):
        assert r["values_ok"] == [True] * 5, (rank, r["values_ok"])
        assert r["has_after"] == [False] * 5
        assert not r["concurrent_errors"], r["concurrent_errors"]
        assert r["concurrent"] == {"a": True, "b": True}, (rank, r["concurrent"])
        assert r["stats"]["pulls"] == r["pulls_expected"]
        assert r["stats"]["timeouts"] == r["stats"]["late_replies"] == r["stats"]["served_errors"] == 0
    # drain returns only once every rank called it: stage 2 drained request 102 1 s late
    for rank in (0, 1):
        assert reports[rank]["drain_returned"][102] >= reports[2]["drain_called"][102]
    # every pull was served once; bytes sent by all == bytes received by all (after close, when every
    # message, goodbyes included, has arrived)
    stats = [r["final_stats"] for r in reports]
    assert sum(s["served"] for s in stats) == sum(s["pulls"] for s in stats)
    assert sum(s["bytes_out"] for s in stats) == sum(s["bytes_in"] for s in stats) > 0
    # 6 drains and a goodbye: each rank told each of its 2 peers
    assert all(s["ctrl_bytes_out"] == s["ctrl_bytes_in"] == 7 * 2 * HDR for s in stats)


# ---------------------------------------------------------------------------------------------- selections


ROW_SELECT = (("index", 0), ("index", -1))


def _scenario_selections(svc: PullService, rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)
    value = (torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g))
    req = 3
    if rank == 0:
        svc.publish(req, 1, 0, value)
        _later(0.3, lambda: svc.publish(req, 2, 0, value))  # a pull waiting for it gets its row
    dist.barrier()
    if rank == 1:
        s0 = dict(svc.stats)
        row = svc.pull(0, req, 1, 0, where="a", select=ROW_SELECT)
        s1 = dict(svc.stats)
        waited = svc.pull(0, req, 2, 0, where="b", select=ROW_SELECT)
        s2 = dict(svc.stats)
        whole = svc.pull(0, req, 1, 0, where="a")
        s3 = dict(svc.stats)
        out["row_same"] = torch.equal(row, value[0][-1]) and torch.equal(waited, value[0][-1])
        out["whole_same"] = ph.same_value(whole, value)
        out["row_in"] = (s1["bytes_in"] - s0["bytes_in"], s2["bytes_in"] - s1["bytes_in"])
        out["row_out"] = s1["bytes_out"] - s0["bytes_out"]
        out["whole_in"] = s3["bytes_in"] - s2["bytes_in"]
        # a selection that does not fit fails as it would applied here, with the same error
        out["misfit"] = _catch(lambda: svc.pull(0, req, 1, 0, where="a", select=(("index", 0), ("index", 9))))
        out["local"] = _catch(lambda: value[0][9])
    dist.barrier()
    ph.drain(svc, req)
    return out


def test_a_pull_with_a_selection_moves_only_the_selected_part(tmp_path: Path) -> None:
    _, r1 = _run(_scenario_selections, 2, tmp_path)
    assert r1["row_same"] and r1["whole_same"]
    row, meta = 32 * 4, 32  # one float32 row; its meta words, padded
    selection = len(fmt.encode_selection(ROW_SELECT))
    assert r1["row_in"] == (HDR + meta + row,) * 2  # published before the pull, and after it
    assert r1["row_out"] == HDR + selection
    assert r1["whole_in"] == HDR + 80 + 2 * 6 * row
    assert r1["misfit"] == r1["local"] and r1["misfit"][0] == "IndexError"


# ------------------------------------------------------------------------------------------ the wires

HUGE = 1 << 22  # float32 elements: a 16 MiB payload, more than a loopback socket takes at once


def _scenario_large_both_ways(svc: PullService, rank: int, world: int) -> dict[str, Any]:
    """Each rank pulls the other's 16 MiB value and a small one at the same time: both wires' writer
    side carries what the sockets do not take at once, in order, with no listener ever blocked."""
    g = torch.Generator().manual_seed(77 + rank)
    mine = {1: torch.randn(HUGE, generator=g), 2: torch.arange(6.0) + rank}
    for key, value in mine.items():
        svc.publish(3, key, 0, value)
    dist.barrier()
    peer = 1 - rank
    big = svc.request(peer, 3, 1, 0, where="big")
    small = svc.request(peer, 3, 2, 0, where="small")
    got_small = svc.wait(small)
    got_big = svc.wait(big)
    theirs = torch.randn(HUGE, generator=torch.Generator().manual_seed(77 + peer))
    out = {
        "big_same": ph.same_value(got_big, theirs),
        "small": got_small.tolist(),
        "value_bytes_in": svc.stats["value_bytes_in"],
    }
    dist.barrier()
    ph.drain(svc, 3)
    return out


def test_large_values_cross_both_ways_at_once_on_either_wire(tmp_path: Path) -> None:
    for wire in ("tcp", "gloo"):
        (tmp_path / wire).mkdir()
        r0, r1 = _run(_scenario_large_both_ways, 2, tmp_path / wire, wire=wire)
        for rank, r in enumerate((r0, r1)):
            assert r["big_same"], (wire, rank)
            assert r["small"] == [float(i + 1 - rank) for i in range(6)], (wire, rank)
            assert r["value_bytes_in"] == HUGE * 4 + 6 * 4, (wire, r)


def _scenario_owner_killed(svc: PullService, rank: int, world: int) -> dict[str, Any]:
    """Stage 0 is killed (SIGKILL) while stage 1 waits for a value stage 0 never published."""
    import os
    import signal

    dist.barrier()
    if rank == 0:
        while svc.held()["waiting"] == 0:  # stage 1's pull has arrived
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    kind, message = _catch(lambda: svc.pull(0, 4, 1, 0, where="model.layers.0.output"))
    return {"kind": kind, "message": message, "broken": svc._broken}


def test_a_pull_fails_when_its_owner_process_dies_not_at_its_deadline(tmp_path: Path) -> None:
    r0, r1 = _run(_scenario_owner_killed, 2, tmp_path, deadline_s=50.0, may_die=frozenset({0}))
    assert r0 is None  # killed before it could report
    assert r1["kind"] == "PullError", r1  # not PullTimeout: the lost connection ends the wait
    assert "model.layers.0.output" in r1["message"] and "stage 0" in r1["message"], r1
    assert "closed its connection" in r1["message"], r1
