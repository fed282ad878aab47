"""Throughput and added latency of ``asyncpp serve`` against vLLM's own OpenAI server, in one run.

Three servers run side by side on the same model (the embedded tiny 4-layer Llama) and the same
engine settings, each in its own process group:

* **vLLM**: ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``) with the settings
  ``asyncpp.VllmEngine`` gives its engine: float32, eager mode, prefix caching and chunked prefill
  off, ``long_prefill_token_threshold`` 0, ``max_model_len`` and ``max_num_batched_tokens`` 512,
  a 1 GiB KV cache, ``max_num_seqs`` 128;
* **asyncpp (budget 2 s)**: ``python -m asyncpp.serve`` with its default ``--block-budget 2``
  (a per-step budget for block code, which turns off a native fast path on the worker);
* **asyncpp (budget 0)**: the same with ``--block-budget 0`` (no budget).

Both asyncpp servers register ``benchmarks/serve_bench_blocks.py`` and allow 64 concurrent requests
(``--max-concurrent``; the default of 16 would refuse a batch of 32). Every server gets the same
environment (``VLLM_LOGGING_LEVEL=WARNING``, no access log) and vLLM's default thread binding
(``VLLM_CPU_OMP_THREADS_BIND`` unset, hence ``auto``: the worker's OpenMP threads on the cores left
after vLLM reserves one for its engine core process; on 2 cores, one each).

Throughput: a batch of B concurrent requests (a fresh ``httpx.AsyncClient``; distinct text prompts of
8-64 tokens, spread evenly, new ones every round; greedy, ``ignore_eos``, 64 new tokens each) is
timed from submission to the last answer: generated tokens / wall seconds. Variants:

* vLLM ``POST /v1/completions`` (the reference);
* asyncpp ``POST /v1/completions``, plain;
* asyncpp ``POST /v1/trace`` (``generate``), one invoke per request, block ``read_every_layer``
  (awaits every decoder layer's output at every step, keeps how many rows it was served);
* asyncpp ``POST /v1/completions`` with ``"asyncpp": {"block": "read_every_layer"}`` attached;
* (info) asyncpp ``POST /v1/trace`` with block ``read_every_layer_norms``: the same reads, plus
  the last position's residual-stream norm of each (three small torch ops of the block's own).

The servers share 2 cores, so only one batch runs at a time. A round runs vLLM's batch between
every two asyncpp batches (V x1 V x2 ... V, the asyncpp variants in rotated order) and each
asyncpp batch is set against the mean wall time of the two vLLM batches around it: load that comes
and goes hits both alike. Each batch waits ``--settle`` seconds (1.2) first: after its last message
a vLLM engine's processes busy-poll their queues for 1 s (``SpinCondition`` in vLLM's
``shm_broadcast``), which would take a core from the next server. Ratios are taken round by round; the median over rounds is reported with
a distribution-free 95% interval. A verdict is PASS or FAIL by the median against the target.
The CPU seconds each server's processes (API server, EngineCore, worker) use during its batch are
set side by side the same way (info): less sensitive to other work on the machine than wall time,
though CPU that vLLM's busy loops and OpenMP threads spend waiting counts too.

Latency of a one-token request: one request at a time, in bursts (after the same pause, 1 + 5
sequential requests to one variant; the first, which opens a connection and wakes the idle engine,
is reported apart), in the same alternation of bursts (V x1 V x2 ... V): vLLM ``/v1/completions``
with ``max_tokens`` 1 against asyncpp ``/v1/trace`` without ``generate`` (one sampled token) with no
block, and with block ``read_one_layer``; and, for reference, asyncpp's ``/v1/completions`` with
``max_tokens`` 1. Added latency = each asyncpp request minus the mean of its two vLLM neighbour
bursts' medians; median and p90 over all counted requests.

Every request must answer 200 with its 64 (or 1) tokens and no block error, or the run stops.
Generated tokens are compared with vLLM's for the same prompt in the same round (reported).

Usage::

    .venv/bin/python benchmarks/serve_throughput.py              # print the tables
    .venv/bin/python benchmarks/serve_throughput.py --write      # and update docs/performance.md
    .venv/bin/python benchmarks/serve_throughput.py --quick      # a short run to try it
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median
from typing import Any

import bench_common
from vllm_throughput import CpuMeter, median_ci, pct

ROOT = bench_common.ROOT
DOC = bench_common.DOC
SECTION = "## Serving throughput against `vllm serve` (benchmarks/serve_throughput.py)"
BLOCKS_FILE = Path(__file__).resolve().parent / "serve_bench_blocks.py"

PLAIN_TARGET = 0.95  # asyncpp /v1/completions vs vLLM's server
BLOCK_TARGET = 0.85  # a block reading every layer every step vs vLLM's plain completions
PROMPT_MIN, PROMPT_MAX = 8, 64
LATENCY_PROMPT = 32
MIN_ROUNDS = 5  # throughput rounds run even past --budget
READY_TIMEOUT = 600.0  # s for a server to answer /v1/models

# the engine settings asyncpp.VllmEngine uses (asyncpp/engines/vllm/engine.py), as vLLM CLI flags
VLLM_FLAGS = [
    "--dtype", "float32",
    "--enforce-eager",
    "--no-enable-prefix-caching",
    "--no-enable-chunked-prefill",
    "--long-prefill-token-threshold", "0",
    "--max-model-len", "512",
    "--max-num-batched-tokens", "512",
    "--kv-cache-memory-bytes", str(2**30),
    "--max-num-seqs", "128",
    "--disable-uvicorn-access-log",
]  # fmt: skip
# asyncpp serve: eager as vLLM's above; the rest are VllmEngine's fixed defaults (no prefix caching
# or chunked prefill, long_prefill_token_threshold 0, max_num_batched_tokens = max_model_len, 1 GiB
# KV cache)
ASYNCPP_FLAGS = [
    "--dtype", "float32",
    "--mode", "eager",
    "--max-model-len", "512",
    "--max-num-seqs", "128",
    "--max-concurrent", "64",
    "--log-level", "warning",  # no access log (as vLLM's above)
    "--blocks", str(BLOCKS_FILE.relative_to(ROOT)),
]  # fmt: skip
SERVER_ENV = {  # (thread binding: vLLM's default, auto, for every server)
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

BUDGETS = {"b2": "2", "b0": "0"}  # asyncpp server key -> --block-budget
SERVER_LABEL = {"vllm": "vLLM", "b2": "asyncpp (budget 2 s)", "b0": "asyncpp (budget 0)"}

# throughput variants: key -> (server, route, block)
TPUT = {
    "vllm": ("vllm", "completions", None),
    **{f"{s}:plain": (s, "completions", None) for s in BUDGETS},
    **{f"{s}:trace": (s, "trace", "read_every_layer") for s in BUDGETS},
    **{f"{s}:attach": (s, "completions", "read_every_layer") for s in BUDGETS},
    **{f"{s}:norms": (s, "trace", "read_every_layer_norms") for s in BUDGETS},
}
# one-token latency variants
LAT = {
    "vllm": ("vllm", "completions", None),
    **{f"{s}:trace": (s, "trace", None) for s in BUDGETS},
    **{f"{s}:trace1": (s, "trace", "read_one_layer") for s in BUDGETS},
    **{f"{s}:plain": (s, "completions", None) for s in BUDGETS},
}
ROUTE_LABEL = {
    "plain": "plain `/v1/completions`",
    "trace": "`/v1/trace`, block reads every layer every step",
    "attach": "`/v1/completions` + attached block reading every layer every step",
    "norms": "`/v1/trace`, block reads every layer every step and takes a norm of each (info)",
}
LAT_LABEL = {
    "trace": "`/v1/trace`, 1 token, no block",
    "trace1": "`/v1/trace`, 1 token, block reads one layer",
    "plain": "`/v1/completions`, `max_tokens` 1",
}

perf = time.perf_counter

TEXT = bench_common.PROMPT_TEXT  # prompts are cut from it


class BenchError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------
# the servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    key: str
    cmd: list[str]
    log_path: Path
    port: int
    proc: subprocess.Popen | None = None
    model: str = ""
    ready_s: float = 0.0
    _log: Any = None
    _procs: list = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict[str, str]) -> None:
        self._log = open(self.log_path, "wb")  # closed by close_log()
        self._t0 = perf()
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: vLLM's EngineCore and worker too
        )

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    async def wait_ready(self, client: Any, timeout: float = READY_TIMEOUT) -> None:
        deadline = perf() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise BenchError(
                    f"{SERVER_LABEL[self.key]} exited ({code}) while starting:\n{self.log_tail()}"
                )
            with contextlib.suppress(Exception):
                r = await client.get(self.base + "/v1/models", timeout=5)
                if r.status_code == 200:
                    self.model = r.json()["data"][0]["id"]
                    self.ready_s = perf() - self._t0
                    self._find_procs()
                    return
            if perf() > deadline:
                raise BenchError(
                    f"{SERVER_LABEL[self.key]} not ready after {timeout:.0f} s:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.5)

    def _find_procs(self) -> None:
        import psutil

        me = psutil.Process(self.proc.pid)
        self._procs = [me, *me.children(recursive=True)]  # API server, EngineCore, worker

    def cpu_seconds(self) -> float:
        """CPU seconds the server's processes have used so far."""
        import psutil

        total = 0.0
        for p in self._procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def send(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def group_alive(self) -> bool:
        if self.proc is None:
            return False
        self.proc.poll()  # reap the leader once it has exited
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_servers(servers: list[Server], grace: float = 30.0) -> None:
    """SIGTERM every server's process group, then SIGKILL what is left after ``grace`` seconds."""
    for s in servers:
        s.send(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(s.group_alive() for s in servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    for s in servers:
        if s.group_alive():
            print(
                f"{SERVER_LABEL[s.key]}: still running {grace:.0f} s after SIGTERM: SIGKILL", file=sys.stderr
            )
            s.send(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(s.group_alive() for s in servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    for s in servers:
        if s.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(timeout=1)
        s.close_log()


def make_servers(logs: Path) -> list[Server]:
    from asyncpp.models import tiny_model_dir

    model = str(tiny_model_dir())
    py = sys.executable
    servers = [
        Server(
            "vllm",
            [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *VLLM_FLAGS],
            logs / "vllm.log",
            free_port(),
        )
    ]
    for key, budget in BUDGETS.items():
        servers.append(
            Server(
                key,
                [py, "-m", "asyncpp.serve", *ASYNCPP_FLAGS, "--block-budget", budget],
                logs / f"asyncpp-{key}.log",
                free_port(),
            )
        )
    for s in servers:
        s.cmd += ["--port", str(s.port)]
    return servers


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    for k, v in SERVER_ENV.items():
        env.setdefault(k, v)
    return env


def log_findings(s: Server) -> dict[str, int]:
    """Counts of the server log's warning / error / traceback lines."""
    text = ""
    with contextlib.suppress(OSError):
        text = s.log_path.read_text(errors="replace")
    return {
        "warnings": len(re.findall(r"\bWARNING\b|warning:", text)),
        "errors": len(re.findall(r"\bERROR\b|error:", text)),
        "tracebacks": text.count("Traceback (most recent call last)"),
    }


# ------------------------------------------------------------------------------------------------
# requests


class Client:
    """Requests to the servers. A batch opens its own connections (a fresh ``httpx.AsyncClient``,
    for every server alike): a pooled connection idle for the servers' keep-alive timeout (5 s)
    could be closed by the server just as a request reuses it."""

    def __init__(self, servers: dict[str, Server], batch: int):
        self.servers = servers
        self.batch_size = batch

    def session(self, keepalive: float = 5.0) -> Any:
        import httpx

        most = 4 * self.batch_size
        limits = httpx.Limits(
            max_connections=most, max_keepalive_connections=most, keepalive_expiry=keepalive
        )
        return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)

    async def one(self, http: Any, variant: tuple[str, str, str | None], prompt: str, n: int) -> list[int]:
        """One request; its generated token ids. Raises BenchError unless it ran as asked."""
        import httpx

        skey, route, block = variant
        s = self.servers[skey]
        where = f"{SERVER_LABEL[skey]} /v1/{route}" + (f" (block {block})" if block else "")
        if route == "completions":
            body: dict[str, Any] = {
                "model": s.model,
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            if block:
                body["asyncpp"] = {"block": block, "args": {}}
        else:
            inv: dict[str, Any] = {"prompt": prompt}
            if block:
                inv.update(block=block, args={})
            body = {"sampling": {"temperature": 0, "ignore_eos": True}, "invokes": [inv]}
            if n > 1:
                body.update(generate=True, max_new_tokens=n)
        try:
            r = await http.post(f"{s.base}/v1/{route}", json=body)
        except httpx.HTTPError as e:
            raise BenchError(f"{where}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise BenchError(f"{where} answered {r.status_code}: {r.text[:500]}")
        d = r.json()
        if route == "completions":
            tokens = d["choices"][0].get("token_ids") or []
            if block:
                a = d.get("asyncpp") or {}
                if a.get("error") is not None or "result" not in a:
                    raise BenchError(f"{where}: the block failed: {a}")
        else:
            item = d["invokes"][0]
            if item.get("error") is not None:
                raise BenchError(f"{where}: the block failed: {item['error']}")
            tokens = item.get("tokens") or []
        if len(tokens) != n:
            raise BenchError(f"{where}: {len(tokens)} tokens, asked for {n} (ignore_eos)")
        return list(tokens)

    async def batch(self, variant: tuple[str, str, str | None], prompts: list[str], n: int) -> Batch:
        s = self.servers[variant[0]]
        c0, t0 = s.cpu_seconds(), perf()
        async with self.session() as http:
            tokens = await asyncio.gather(*(self.one(http, variant, p, n) for p in prompts))
        wall = perf() - t0
        return Batch(wall, s.cpu_seconds() - c0, list(tokens))


@dataclass
class Batch:
    wall: float
    cpu: float  # s of CPU the server's processes used meanwhile
    tokens: list[list[int]]


def make_prompts(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct text prompts, lengths spread evenly over PROMPT_MIN..PROMPT_MAX characters
    (the tiny model's tokenizer is byte-level: one token per character), in shuffled order."""
    if count == 1:
        lengths = [(PROMPT_MIN + PROMPT_MAX) // 2]
    else:
        lengths = [PROMPT_MIN + round(i * (PROMPT_MAX - PROMPT_MIN) / (count - 1)) for i in range(count)]
    rng.shuffle(lengths)
    out: list[str] = []
    seen = set()
    for n in lengths:
        while True:
            start = rng.randrange(0, len(TEXT) - n)
            p = TEXT[start : start + n]
            if p not in seen:
                seen.add(p)
                out.append(p)
                break
    return out


def latency_prompt(rng: random.Random) -> str:
    start = rng.randrange(0, len(TEXT) - LATENCY_PROMPT)
    return TEXT[start : start + LATENCY_PROMPT]


def alternate(variants: list[str], rnd: int) -> list[str]:
    """The asyncpp variants in rotated order, with vLLM's before, between and after them."""
    k = rnd % len(variants)
    order = variants[k:] + variants[:k]
    seq = ["vllm"]
    for v in order:
        seq += [v, "vllm"]
    return seq


def against_neighbours(seq: list[str], values: list[float]) -> dict[str, tuple[float, float]]:
    """For each asyncpp variant of a round: (its value, the mean of its two vLLM neighbours)."""
    return {v: (values[i], mean([values[i - 1], values[i + 1]])) for i, v in enumerate(seq) if v != "vllm"}


# ------------------------------------------------------------------------------------------------
# the run


@dataclass
class Results:
    batch: int
    new_tokens: int
    rounds: int = 0
    latency_rounds: int = 0
    # throughput: variant -> per round (wall s, reference vLLM wall s); vLLM's own walls
    tput: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    vllm_walls: list[float] = field(default_factory=list)
    cpu: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # the same, server CPU s
    vllm_cpu: list[float] = field(default_factory=list)
    # latency: variant -> per round (s, reference vLLM s); vLLM's own
    lat: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    vllm_lat: list[float] = field(default_factory=list)
    lat_first: dict[str, list[float]] = field(default_factory=dict)  # variant -> each burst's first, s
    # tokens: variant -> [requests equal to vLLM's for the same prompt, requests]
    same: dict[str, list[int]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    load: dict[str, str] = field(default_factory=dict)
    ready: dict[str, float] = field(default_factory=dict)
    logs: dict[str, dict[str, int]] = field(default_factory=dict)

    def ratios(self, v: str) -> list[float]:
        return [ref / wall for wall, ref in self.tput[v]]  # same tokens: tok/s ratio

    def cpu_ratios(self, v: str) -> list[float]:
        return [ref / cpu for cpu, ref in self.cpu[v]]

    def tps(self, v: str) -> list[float]:
        toks = self.batch * self.new_tokens
        if v == "vllm":
            return [toks / w for w in self.vllm_walls]
        return [toks / w for w, _ in self.tput[v]]

    def added(self, v: str) -> list[float]:
        return [x - ref for x, ref in self.lat[v]]


def compare_tokens(res: Results, v: str, got: list[list[int]], want: list[list[int]]) -> None:
    same = res.same.setdefault(v, [0, 0])
    same[0] += sum(g == w for g, w in zip(got, want, strict=True))
    same[1] += len(got)


async def measure(client: Client, args: argparse.Namespace) -> Results:
    res = Results(batch=args.batch, new_tokens=args.new_tokens)
    rng = random.Random(args.seed)
    n = args.new_tokens
    asyncpp_tput = [v for v in TPUT if v != "vllm"]
    asyncpp_lat = [v for v in LAT if v != "vllm"]

    # warm-up: every variant once, untimed
    t0 = perf()
    prompts = make_prompts(rng, args.batch)
    for v in TPUT:
        await client.batch(TPUT[v], prompts, n)
    async with client.session() as http:
        for v in LAT:
            for _ in range(3):
                await client.one(http, LAT[v], latency_prompt(rng), 1)
    res.seconds["warm-up"] = perf() - t0

    # throughput rounds
    t0 = perf()
    for rnd in range(args.rounds):
        if rnd >= MIN_ROUNDS and perf() - t0 > args.budget:
            break  # a busy machine: fewer rounds rather than a run of many minutes
        prompts = make_prompts(rng, args.batch)
        seq = alternate(asyncpp_tput, rnd)
        walls, cpus, reference = [], [], None
        for v in seq:
            await asyncio.sleep(args.settle)  # the last server's engine stops spinning
            b = await client.batch(TPUT[v], prompts, n)
            walls.append(b.wall)
            cpus.append(b.cpu)
            if v == "vllm":
                reference = reference or b.tokens
                res.vllm_walls.append(b.wall)
                res.vllm_cpu.append(b.cpu)
            compare_tokens(res, v, b.tokens, reference)
        for v, pair in against_neighbours(seq, walls).items():
            res.tput.setdefault(v, []).append(pair)
        for v, pair in against_neighbours(seq, cpus).items():
            res.cpu.setdefault(v, []).append(pair)
        res.rounds = rnd + 1
        shown = " ".join(f"{v}={ref / w:.2f}" for v, (w, ref) in against_neighbours(seq, walls).items())
        print(f"throughput round {rnd + 1}: {shown}", file=sys.stderr, flush=True)
    res.seconds["throughput"] = perf() - t0

    # one-token latency rounds: bursts of one-at-a-time requests to one variant, after a pause;
    # one client whose connections are dropped after 2 s idle (before the servers' keep-alive
    # timeout), so each burst's first request opens a connection, and is not counted
    t0 = perf()
    async with client.session(keepalive=2.0) as http:
        for rnd in range(args.latency_rounds):
            prompts = [latency_prompt(rng) for _ in range(args.burst + 1)]
            seq = alternate(asyncpp_lat, rnd)
            groups, reference = [], None
            for v in seq:
                await asyncio.sleep(args.settle)
                times, tokens = [], []
                for p in prompts:
                    t = perf()
                    tokens.append(await client.one(http, LAT[v], p, 1))
                    times.append(perf() - t)
                if v == "vllm":
                    reference = reference or tokens
                compare_tokens(res, "lat:" + v, tokens, reference)
                res.lat_first.setdefault(v, []).append(times[0])
                groups.append(times[1:])
            for i, v in enumerate(seq):
                if v == "vllm":
                    res.vllm_lat += groups[i]
                else:
                    ref = mean([median(groups[i - 1]), median(groups[i + 1])])
                    res.lat.setdefault(v, []).extend((x, ref) for x in groups[i])
            res.latency_rounds = rnd + 1
    res.seconds["latency"] = perf() - t0
    return res


# ------------------------------------------------------------------------------------------------
# the report


def verdict(m: float, lo: float, hi: float, target: float) -> str:
    if m >= target:
        return "PASS" if lo >= target else "PASS (median; the 95% interval reaches below the target)"
    return "**FAIL**" if hi < target else "**FAIL** (median; the 95% interval reaches the target)"


def ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def report(res: Results) -> tuple[str, str]:
    rows = [
        [
            f"vLLM server, plain `/v1/completions`, B={res.batch}: tokens/s (median of rounds)",
            f"{median(res.tps('vllm')):.0f} tok/s",
            "-",
            "info",
        ]
    ]
    targets = (("plain", PLAIN_TARGET), ("trace", BLOCK_TARGET), ("attach", BLOCK_TARGET), ("norms", None))
    for route, target in targets:
        for s in BUDGETS:
            v = f"{s}:{route}"
            rs = res.ratios(v)
            m, (lo, hi) = median(rs), median_ci(rs)
            rows.append(
                [
                    f"{SERVER_LABEL[s]}, {ROUTE_LABEL[route]} / vLLM plain",
                    f"{m:.3f}x [{lo:.3f}, {hi:.3f}] ({median(res.tps(v)):.0f} tok/s)",
                    "-" if target is None else f">= {target}x",
                    "info" if target is None else verdict(m, lo, hi, target),
                ]
            )
    for route, _ in targets:
        for sk in BUDGETS:
            v = f"{sk}:{route}"
            rs = res.cpu_ratios(v)
            m, (lo, hi) = median(rs), median_ci(rs)
            cpu = median(c for c, _ in res.cpu[v])
            rows.append(
                [
                    f"{SERVER_LABEL[sk]}, {ROUTE_LABEL[route]}: the servers' CPU seconds per batch, vLLM / asyncpp",
                    f"{m:.3f}x [{lo:.3f}, {hi:.3f}] ({cpu:.2f} s vs {median(res.vllm_cpu):.2f} s)",
                    "-",
                    "info",
                ]
            )
    vl = res.vllm_lat
    rows.append(
        [
            "vLLM server, one-token `/v1/completions` (`max_tokens` 1), one at a time: median (p90)",
            f"{ms(median(vl))} ({ms(pct(vl, 0.9))})",
            "-",
            "info",
        ]
    )
    for kind in ("trace", "trace1", "plain"):
        for s in BUDGETS:
            v = f"{s}:{kind}"
            add, own = res.added(v), [x for x, _ in res.lat[v]]
            rows.append(
                [
                    f"{SERVER_LABEL[s]}, {LAT_LABEL[kind]}: added latency vs vLLM, median (p90)",
                    f"{median(add) * 1e3:+.1f} ms ({pct(add, 0.9) * 1e3:+.1f} ms); "
                    f"itself {ms(median(own))} ({ms(pct(own, 0.9))})",
                    "-",
                    "info",
                ]
            )
    main = bench_common.md_table(["measure", "value", "target", "verdict"], rows)

    # details
    drows = []
    for v in TPUT:
        t = res.tps(v)
        label = (
            "vLLM, plain `/v1/completions`"
            if v == "vllm"
            else f"{SERVER_LABEL[v.split(':')[0]]}, {ROUTE_LABEL[v.split(':')[1]]}"
        )
        walls = res.vllm_walls if v == "vllm" else [w for w, _ in res.tput[v]]
        cpus = res.vllm_cpu if v == "vllm" else [c for c, _ in res.cpu[v]]
        drows.append(
            [
                label,
                f"{median(t):.0f}",
                f"{pct(t, 0.1):.0f}",
                f"{pct(t, 0.9):.0f}",
                f"{median(walls) * 1e3:.0f}",
                f"{median(cpus) * 1e3:.0f}",
                str(len(t)),
            ]
        )
    tput_t = bench_common.md_table(
        [
            f"B={res.batch}, variant",
            "median tok/s",
            "p10",
            "p90",
            "median wall ms",
            "median server CPU ms",
            "batches",
        ],
        drows,
    )
    rrows = [
        [
            f"{SERVER_LABEL[v.split(':')[0]]}, {v.split(':')[1]}",
            " ".join(f"{x:.2f}" for x in sorted(res.ratios(v))),
        ]
        for v in TPUT
        if v != "vllm"
    ]
    ratio_t = bench_common.md_table(["ratio to vLLM, per round", "every round's value, sorted"], rrows)
    lrows = []
    for v in LAT:
        xs = res.vllm_lat if v == "vllm" else [x for x, _ in res.lat[v]]
        label = "vLLM, `/v1/completions` `max_tokens` 1" if v == "vllm" else (
            f"{SERVER_LABEL[v.split(':')[0]]}, {LAT_LABEL[v.split(':')[1]]}"
        )  # fmt: skip
        first = res.lat_first[v]
        lrows.append(
            [
                label,
                ms(median(xs)),
                ms(pct(xs, 0.1)),
                ms(pct(xs, 0.9)),
                str(len(xs)),
                f"{ms(median(first))} ({ms(max(first))})",
            ]
        )
    lat_t = bench_common.md_table(
        ["one-token request", "median", "p10", "p90", "requests", "first of a burst, median (max)"], lrows
    )
    srows = []
    for v, (same, total) in res.same.items():
        name = v.removeprefix("lat:")
        if name == "vllm":
            continue
        table = LAT if v.startswith("lat:") else TPUT
        skey, route, block = table[name]
        what = f"{SERVER_LABEL[skey]} /v1/{route}" + (f" + {block}" if block else "")
        srows.append(
            [
                what + (" (1 token)" if v.startswith("lat:") else f" ({res.new_tokens} tokens)"),
                f"{same}/{total}",
            ]
        )
    same_t = bench_common.md_table(
        ["tokens equal to vLLM's for the same prompt and round", "requests"], srows
    )
    return main, "\n\n".join([tput_t, ratio_t, lat_t, same_t])


def render(res: Results, main: str, details: str, info: dict[str, str], args: argparse.Namespace) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = "\n".join(f"- {k}: {v}" for k, v in {**info, **res.load}.items())
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in res.seconds.items())
    ready = ", ".join(f"{SERVER_LABEL[k]} {v:.0f} s" for k, v in res.ready.items())
    logs = "; ".join(
        f"{SERVER_LABEL[k]}: " + ", ".join(f"{n} {what}" for what, n in f.items())
        for k, f in res.logs.items()
    )
    rounds = f"{res.rounds} rounds"
    if res.rounds < args.rounds:
        rounds += f" (of {args.rounds}: the time budget of {args.budget:.0f} s ran out)"
    py = bench_common.command_line(__file__).split(" ", 1)[0]
    vllm_cmd = " ".join([py, "-m vllm.entrypoints.openai.api_server --model TINY", *VLLM_FLAGS, "--port P"])
    asyncpp_cmd = " ".join([py, "-m asyncpp.serve", *ASYNCPP_FLAGS, "--block-budget 2|0 --port P"])
    return f"""{SECTION}

Three servers, started together and alive for the whole run, on the embedded tiny 4-layer Llama
(TINY: `asyncpp.models.tiny_model_dir()`) with the engine settings `asyncpp.VllmEngine` uses:

- vLLM: `{vllm_cmd}`
- asyncpp, twice (the default block budget of 2 s, and none): `{asyncpp_cmd}`

Every server runs with vLLM's default thread binding (`VLLM_CPU_OMP_THREADS_BIND` unset, hence
`auto`: the worker's OpenMP threads on the cores left after vLLM reserves one for its engine core
process; here one each) and gets `VLLM_LOGGING_LEVEL=WARNING`,
`HF_HUB_OFFLINE=1`, `TOKENIZERS_PARALLELISM=false`. `--max-concurrent 64` lifts asyncpp's own
per-client limit of 16 concurrent requests (it has no vLLM counterpart), so that a batch of
{res.batch} is served at all.

Throughput: batches of {res.batch} concurrent requests, each from a fresh `httpx.AsyncClient` (its
own connections, for every server alike; distinct text prompts of {PROMPT_MIN}-{PROMPT_MAX} tokens spread
evenly, new ones each round; greedy, `ignore_eos`, {res.new_tokens} new tokens each), timed from
submission to the last answer; generated tokens / wall seconds. The servers share the machine's
cores, so one batch runs at a time: each round runs vLLM's plain `/v1/completions` batch before,
between and after the eight asyncpp batches (in rotated order), and each asyncpp batch is set against
the mean wall time of its two vLLM neighbours. Every batch starts after a pause of {args.settle:g} s: a
vLLM engine's processes (EngineCore, worker) busy-poll their shared-memory queues for 1 s after
their last message (`SpinCondition`, vLLM's `shm_broadcast.py`), and would otherwise take a core
from the next server for the first second of its batch. {rounds} after
a warm-up of every variant; the median ratio over rounds with a distribution-free 95% interval; the
verdict is the median against the target. The block (`benchmarks/serve_bench_blocks.py`,
`read_every_layer`) awaits every decoder layer's output at every step and keeps how many rows it
was served (the cost of the reads themselves, as in the vLLM decode benchmark above); it rides on a
`/v1/trace` `generate` request (one invoke each) or is attached to a `/v1/completions` request
(`"asyncpp": {{"block": ...}}`). For information, `read_every_layer_norms` makes the same reads and
takes the last position's residual-stream norm of each (three small torch ops per read, the
block's own work), on `/v1/trace`.

One-token latency: one request at a time, in bursts of 1 + {args.burst} sequential requests to one
variant after the same pause (the first of a burst opens a connection and wakes the idle engine: it is
reported apart, in the details), {res.latency_rounds} rounds of the same alternation of bursts (vLLM's
`max_tokens` 1 completions before, between and after the asyncpp bursts); added latency is each
counted asyncpp request minus the mean of its two vLLM neighbour bursts' medians, median and p90 over
all counted requests. A trace without `generate` samples one token; `read_one_layer` awaits layer
0's output.

The servers' CPU rows: CPU seconds of a server's processes (API server, EngineCore, worker;
`psutil`) during its batch, against its vLLM neighbours' in the same way (less sensitive to other
work than wall time, though the CPU that busy loops and OpenMP threads spend waiting counts too).

Every request answered 200 with all its tokens and no block error (the run stops otherwise).
Server start (to `/v1/models` answering, started together): {ready}. Server logs: {logs}.

Command: `{bench_common.command_line(__file__)}` ({date}; {secs})

{machine}

{main}

<details><summary>Every variant</summary>

{details}

</details>
"""


# ------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests per batch (default 32)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--rounds", type=int, default=12, help="throughput rounds (default 12)")
    ap.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help=f"no new throughput round after this many seconds, once {MIN_ROUNDS} are done (default 420)",
    )
    ap.add_argument("--latency-rounds", type=int, default=8, help="one-token latency rounds (default 8)")
    ap.add_argument(
        "--burst", type=int, default=5, help="counted one-token requests per variant and round (default 5)"
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=1.2,
        help="seconds of pause before each batch and burst: vLLM's engine processes busy-poll for 1 s "
        "after their last message, and would take a core from the next server (default 1.2)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a short run (3 + 2 rounds) to try the script")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (printed path)")
    ap.add_argument("--write", action="store_true", help="update the section in docs/performance.md")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.latency_rounds = 3, 2
    if args.batch < 2 or args.new_tokens < 2 or min(args.rounds, args.latency_rounds, args.burst) < 1:
        ap.error("--batch and --new-tokens must be >= 2, the rounds and --burst >= 1")
    if args.settle < 0:
        ap.error("--settle must be >= 0")
    return args


def vllm_version() -> str:
    """vLLM's version, without importing it (the package is ``vllm`` or ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{importlib.metadata.version(dist)} ({dist})"
    return "?"


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds to the finally that stops the servers


async def run_all(servers: list[Server], args: argparse.Namespace, res_box: list[Results]) -> None:
    client = Client({s.key: s for s in servers}, args.batch)
    async with client.session() as http:
        env = server_env()
        for s in servers:
            s.start(env)
        await asyncio.gather(*(s.wait_ready(http) for s in servers))
        print(
            "servers ready: " + ", ".join(f"{SERVER_LABEL[s.key]} {s.ready_s:.0f} s" for s in servers),
            file=sys.stderr,
            flush=True,
        )
        meter = CpuMeter()
        meter.start()
        res = await measure(client, args)
        wall, mine, other = meter.stop()
        res.load["CPU use during the measurement"] = (
            f"the servers and this client {mine:.2f} cores, everything else {other:.2f} cores, "
            f"of {bench_common.usable_cores()} ({wall:.0f} s)"
        )
        res.ready = {s.key: s.ready_s for s in servers}
        res_box.append(res)


def main() -> int:
    args = parse_args()
    info = bench_common.machine_info(extra={"vllm": vllm_version()})
    logs = Path(tempfile.mkdtemp(prefix="serve_throughput-"))
    servers = make_servers(logs)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    box: list[Results] = []
    try:
        asyncio.run(run_all(servers, args, box))
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        for s in servers:
            if s.proc is not None and s.proc.poll() is not None:
                print(f"{SERVER_LABEL[s.key]} exited ({s.proc.returncode}):\n{s.log_tail()}", file=sys.stderr)
            elif s.proc is not None and log_findings(s)["tracebacks"]:
                print(f"{SERVER_LABEL[s.key]} logged tracebacks:\n{s.log_tail(60)}", file=sys.stderr)
    finally:
        stop_servers(servers)
        if not box or args.keep_logs:
            print(f"the servers' logs: {logs}", file=sys.stderr)
    if not box:
        return 1
    res = box[0]
    res.logs = {s.key: log_findings(s) for s in servers}
    if not args.keep_logs:
        shutil.rmtree(logs, ignore_errors=True)
    if hasattr(os, "getloadavg"):
        res.load["load average after the run"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    main_table, details = report(res)
    text = render(res, main_table, details, info, args)
    print(text)
    if args.write:
        bench_common.write_section(SECTION, text, DOC)
        print(f"wrote the section to {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
