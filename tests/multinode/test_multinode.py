"""Multi-node engines, tested as two nodes on one host: the head is a VllmEngine in this process
(node 0), the other node a real ``asyncpp serve --headless`` process started here (node 1), both on
vLLM's multiprocessing executor over 127.0.0.1. The same blocks run on a one-stage engine, and the
results are compared: argmax equal and cosine similarity >= 0.9999 at float32.

Every node process is started with a hard deadline and killed (its whole process group) at the
end of its test, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import cross_stage_rmw, generate_with_cross_stage_write, same, same_logits

import asyncpp

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

PROMPT = "The quick brown fox"
NODE_EXIT_S = 60  # a headless node ends by itself once the head's engine has closed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """A headless node process (``asyncpp serve --headless``), its output in a log file."""

    def __init__(
        self, log: Path, port: int, *options: str, env: dict[str, str] | None = None, prefix: tuple = ()
    ):
        self.log = log
        argv = [
            *prefix,
            sys.executable, "-m", "asyncpp.serve", "--headless", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--mode", "eager", *options,
        ]  # fmt: skip
        self._out = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed whole at the end
            env={**os.environ, **(env or {})},
        )

    def text(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def close(self) -> None:
        self.kill()
        with_group(self.proc.pid, signal.SIGKILL)  # its workers, should any be left
        self._out.close()


def with_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_two_nodes(tmp: Path, *options: str, **engine: object) -> tuple[asyncpp.VllmEngine, Node]:
    """The head (this process) and node 1 (a headless process) of one engine."""
    port = free_port()
    node = Node(tmp / "node1.log", port, *options, env={"ASYNCPP_STACK_DUMP": str(tmp)})
    os.environ["ASYNCPP_STACK_DUMP"] = str(tmp)  # the head's workers inherit it
    try:
        head = asyncpp.VllmEngine(
            mode="eager", nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
            node_timeout=180, **engine,
        )  # fmt: skip
    except BaseException:
        node.close()
        raise
    finally:
        del os.environ["ASYNCPP_STACK_DUMP"]
    return head, node


@contextlib.contextmanager
def stacks_if_hung(head: asyncpp.VllmEngine, tmp: Path, seconds: float = 200.0) -> Iterator[None]:
    """Should the body still run after ``seconds`` (a hung pipeline: the test's timeout is near),
    every worker of both nodes dumps its threads' stacks (SIGUSR1, into ``tmp``; the workers were
    started with ASYNCPP_STACK_DUMP there) and they are printed, so the failure report shows
    what each worker waits on."""
    pids = [s["pid"] for s in head.worker_stats()]
    done = threading.Event()

    def dump() -> None:
        if done.wait(seconds):
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(3)
        for pid in pids:
            f = tmp / f"asyncpp-stacks-{pid}.txt"
            print(f"--- worker {pid}, still running after {seconds:.0f} s ---")
            print(f.read_text() if f.exists() else "(no stack file)", flush=True)

    watcher = threading.Thread(target=dump, name="stacks-if-hung", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def close_two_nodes(head: asyncpp.VllmEngine, node: Node) -> float | None:
    """Close the head; seconds until node 1 ended by itself (None: it did not, and was killed)."""
    try:
        head.close()
        start = time.monotonic()
        try:
            node.proc.wait(NODE_EXIT_S)
            return time.monotonic() - start
        except subprocess.TimeoutExpired:
            return None
    finally:
        node.close()


@pytest.fixture(scope="module")
def one_stage():
    engine = asyncpp.VllmEngine(mode="eager")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def pp_nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp-nodes")
    head, node = start_two_nodes(tmp, "--pipeline-parallel-size", "2", pipeline_parallel_size=2)
    yield head, node, tmp
    assert close_two_nodes(head, node) is not None, (
        f"node 1 did not end after the head closed:\n{node.text()}"
    )


def run(engine, block, prompt=PROMPT, **kw):
    entry = asyncpp.generate if "max_new_tokens" in kw else asyncpp.trace
    with entry(engine, **kw) as t:
        h = t.invoke(prompt, block)
    return h


# --- blocks (every worker on every node runs them) -----------------------------------------------


async def read_logits_and_hidden(m):
    early = await m.std.layers[0].resid_out  # stage 0 of 2: node 0
    late = await m.std.layers[3].resid_out  # stage 1 of 2: node 1
    return {"early": early.clone(), "late": late.clone(), "logits": (await m.std.logits).clone()}


async def stream_and_pull(m):
    logits = await m.logits  # node 1's: a lazy value on node 0
    top = await asyncpp.pull(logits.argmax(-1))
    asyncpp.emit(int(top[0]))
    return int(top[0])


async def long_generation(m):
    async for _ in m.steps():
        await m.model.layers[0].output
        await m.model.layers[3].output
    return "finished"


def check_parity(one, split) -> None:
    a, b = run(one, read_logits_and_hidden).result, run(split, read_logits_and_hidden).result
    for k in ("early", "late"):
        same(a[k], b[k])
    same_logits(a["logits"], b["logits"])
    same_logits(run(one, cross_stage_rmw).result, run(split, cross_stage_rmw).result)
    g1 = run(one, generate_with_cross_stage_write, max_new_tokens=5)
    g2 = run(split, generate_with_cross_stage_write, max_new_tokens=5)
    assert g1.tokens.tolist() == g2.tokens.tolist()
    assert [int(t) for t in g2.result] == g2.tokens[0].tolist()


def check_no_state_left(engine) -> None:
    async def many(n):
        async def one(i):
            async with asyncpp.trace(engine) as t:
                h = t.invoke("Hello" * (1 + i % 3), cross_stage_rmw if i % 2 else stream_and_pull)
            return h

        return await asyncio.gather(*(one(i) for i in range(n)))

    hs = asyncio.run(many(12))
    assert all(h.emitted == [h.result] for h in hs[::2])
    keys = ("requests", "blocks", "waits", "parked_pulls", "buffered", "waiting", "drains", "open_pulls")
    end = time.monotonic() + 10
    while True:
        held = [{k: s[k] for k in keys if s.get(k)} for s in engine.worker_stats()]
        if not any(held) or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert not any(held), held


# --- tests ---------------------------------------------------------------------------------------


def test_pp2_one_stage_per_node_matches_one_stage(one_stage, pp_nodes):
    head, node, _ = pp_nodes
    check_parity(one_stage, head)
    assert "joined" in node.text()


def test_every_worker_of_both_nodes_is_seen(one_stage, pp_nodes):
    head, _, _ = pp_nodes
    stats = head.worker_stats()
    assert len(stats) == 2 and len({s["pid"] for s in stats}) == 2
    ref = one_stage.worker_trees()[0]
    assert head.worker_trees() == [ref, ref]
    where = head._watch.fds.values()  # both nodes are on this host: every worker is watched by pid
    assert sorted(p.where for p in where if p.worker) == [
        ", pipeline stage 0, tensor-parallel rank 0, node 0",
        ", pipeline stage 1, tensor-parallel rank 0, node 1",
    ]


def test_pulls_cross_between_the_nodes(pp_nodes):
    head, _, _ = pp_nodes
    before = [s["pulled_value_bytes"] for s in head.worker_stats()]
    run(head, cross_stage_rmw)
    after = [s["pulled_value_bytes"] for s in head.worker_stats()]
    assert after[1] > before[1]  # node 1 (stage 1) pulled layer 0's output from node 0


def test_streamed_values_and_no_state_left(pp_nodes):
    head, _, _ = pp_nodes
    check_no_state_left(head)


def test_stack_dump_signal_on_both_nodes(pp_nodes):
    head, _, tmp = pp_nodes
    pids = [s["pid"] for s in head.worker_stats()]
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    files = [tmp / f"asyncpp-stacks-{pid}.txt" for pid in pids]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(f.exists() and "File" in f.read_text() for f in files):
        time.sleep(0.2)
    for f in files:
        text = f.read_text()
        assert "Thread 0x" in text and "File" in text, text[:500]
    assert run(head, cross_stage_rmw).result is not None  # the workers go on


def test_tp2_pp2_as_two_nodes_of_two_workers(one_stage, tmp_path):
    head, node = start_two_nodes(
        tmp_path,
        "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2",
        pipeline_parallel_size=2, tensor_parallel_size=2,
    )  # fmt: skip
    try:
        with stacks_if_hung(head, tmp_path):
            check_parity(one_stage, head)
            stats = head.worker_stats()
            assert len(stats) == 4 and len({s["pid"] for s in stats}) == 4
            ref = one_stage.worker_trees()[0]
            assert all(tree == ref for tree in head.worker_trees())
            check_no_state_left(head)
    finally:
        ended = close_two_nodes(head, node)
    assert ended is not None, f"node 1 did not end after the head closed:\n{node.text()}"


def test_a_killed_node_fails_its_requests_and_the_engine_closes(tmp_path):
    head, node = start_two_nodes(tmp_path, "--pipeline-parallel-size", "2", pipeline_parallel_size=2)
    try:
        assert run(head, cross_stage_rmw).result is not None

        async def kill_mid_request():
            async with asyncpp.generate(head, max_new_tokens=400) as t:
                h = t.invoke(PROMPT, long_generation)
                await asyncio.sleep(1.0)
                with_group(node.proc.pid, signal.SIGKILL)  # the node process and its worker
            return h

        with pytest.raises(asyncpp.EngineDeadError) as info:
            asyncio.run(asyncio.wait_for(kill_mid_request(), 60))
        assert "node 1" in str(info.value) and "rank 1" in str(info.value), str(info.value)
        with pytest.raises(asyncpp.EngineDeadError):
            run(head, cross_stage_rmw)
        head.close()
    finally:
        head.close()
        node.close()


# a node process in a PID namespace of its own: its pids mean nothing on the head's side, as on
# another host, so the head learns of its end through the workers' links only
OTHER_HOST = ("unshare", "--pid", "--fork", "--mount-proc")


def _can_unshare() -> bool:
    try:
        return subprocess.run([*OTHER_HOST, "true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare(1) with PID namespaces (root)")
def test_a_node_seen_as_another_host_is_watched_through_its_links(tmp_path):
    port = free_port()
    node = Node(tmp_path / "node1.log", port, "--pipeline-parallel-size", "2", prefix=OTHER_HOST)
    head = None
    try:
        head = asyncpp.VllmEngine(
            mode="eager", pipeline_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
            master_port=port, node_timeout=180,
        )  # fmt: skip
        watched = [p.name for p in head._watch.fds.values() if p.worker]
        assert watched == ["vLLM worker rank 0"]  # node 1's pids are not this host's
        assert run(head, cross_stage_rmw).result is not None

        async def kill_mid_request():
            async with asyncpp.generate(head, max_new_tokens=400) as t:
                t.invoke(PROMPT, long_generation)
                await asyncio.sleep(1.0)
                with_group(node.proc.pid, signal.SIGKILL)

        with pytest.raises(
            asyncpp.EngineDeadError, match=r"the link to vLLM worker rank 1.*node 1.*was lost"
        ):
            asyncio.run(asyncio.wait_for(kill_mid_request(), 60))
        head.close()
    finally:
        if head is not None:
            head.close()
        node.close()


def test_a_node_that_never_arrives_fails_the_start(tmp_path):
    from asyncpp.engines.vllm import lifeline

    before = lifeline.children()
    with pytest.raises(asyncpp.AsyncppError, match=r"node_timeout=15 s.*run_node.*--headless"):
        asyncpp.VllmEngine(
            mode="eager", pipeline_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
            master_port=free_port(), node_timeout=15,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while lifeline.children() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not lifeline.children() - before  # the engine core it started is gone


def test_a_node_whose_head_never_arrives_stops(tmp_path):
    node = Node(tmp_path / "node1.log", free_port(), "--pipeline-parallel-size", "2", "--node-timeout", "10")
    try:
        assert node.proc.wait(120) == 1, node.text()
        text = node.text()
        assert "did not join the head node's at 127.0.0.1" in text and "node_timeout=10 s" in text, text
        deadline = time.monotonic() + 30  # and its worker is gone with it
        while time.monotonic() < deadline and _group_alive(node.proc.pid):
            time.sleep(0.2)
        assert not _group_alive(node.proc.pid)
    finally:
        node.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"nnodes": 2, "node_rank": 1, "pipeline_parallel_size": 2}, r"node_rank=1.*head node.*run_node"),
        ({"nnodes": 2, "node_rank": 2}, r"node_rank=2 is not a node of nnodes=2"),
        (
            {"nnodes": 2, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
            r"'ray'.*multiprocessing executor",
        ),
        ({"nnodes": 2, "tensor_parallel_size": 3}, r"3 workers cannot be split evenly over nnodes=2"),
    ],
)
def test_bad_multi_node_options_fail_before_anything_starts(options, match):
    with pytest.raises(ValueError, match=match):
        asyncpp.VllmEngine(mode="eager", **options)


def test_run_node_refuses_the_head_and_a_one_node_engine():
    from asyncpp.engines.vllm import run_node

    with pytest.raises(ValueError, match=r"node 0 is the head"):
        run_node(node_rank=0, nnodes=2)
    with pytest.raises(ValueError, match=r"node 0 is the head|not a node"):
        run_node(node_rank=1, nnodes=1)


def test_serve_headless_needs_the_node_options():
    out = subprocess.run(
        [sys.executable, "-m", "asyncpp.serve", "--headless", "--nnodes", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--headless needs --node-rank" in out.stderr


def test_asyncpp_serve_as_the_head_node(one_stage, tmp_path):
    import httpx
    from serve_helpers import FAILING_AND_SLOW_BLOCKS, ROOT_SECRET, start_server

    from asyncpp.serve import wire

    port = free_port()
    node = Node(tmp_path / "node1.log", port, "--pipeline-parallel-size", "2", "--dtype", "float32")
    head_options = (
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--pipeline-parallel-size", "2", "--mode", "eager", "--node-timeout", "180",
    )  # fmt: skip
    server = start_server(tmp_path, FAILING_AND_SLOW_BLOCKS, *head_options)
    try:
        srv = next(server)
        payload = {"invokes": [{"prompt": PROMPT, "block": "read_layer", "args": {"layer": 3}}]}
        r = httpx.post(
            srv.url + "/v1/trace",
            json=payload,
            headers={"Authorization": f"Bearer {ROOT_SECRET}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text[:500]
        got = wire.decode_body(r.content, r.headers["content-type"])["invokes"][0]
        assert got["error"] is None

        async def read_layer(m):
            return (await m.std.layers[3].resid_out)[0, -1].float().clone()

        ref = run(one_stage, read_layer)
        same(ref.result, got["result"])
        assert got["tokens"] == ref.tokens[0].tolist()
        server.close()  # stops the server (SIGTERM): its engine closes, and node 1 ends by itself
        node.proc.wait(NODE_EXIT_S)
    finally:
        server.close()
        node.close()
