"""The vLLM engine: asyncpp blocks on a real vLLM engine (``AsyncLLM``), one request per invoke.

The engine owns an ``AsyncLLM`` on a private event loop in a background thread, so it serves sync
scripts and async applications (asyncio, uvloop, trio) alike, and many traces at once: each invoke
becomes a vLLM request carrying its block, and vLLM batches all of them continuously. When a
request has ended, its block's outcome arrives from the workers with the request's end. Values blocks
stream (``asyncpp.emit``) come over a channel of their own as they are made (``stream.py``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import gc
import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ...kernel.budget import StepBudget
from ...kernel.errors import AsyncppError, EngineDeadError
from ...locations import standard
from ...locations.footprint import block_footprint
from ...locations.standard import StandardViewError
from ...locations.tree import tree_from_paths
from ...pp.merge import NOT_HERE, merge
from ...pp.pulls import PullError
from ..base import Engine, InvokeOutcome, RunOutcome, RunSpec
from ..bridge import await_future
from ..inputs import InputError, token_rows
from . import console, lifeline, sampling, start_errors
from .keys import ALIASES, EAGER_KEY, EXTRA_KEY, ID_KEY, LIVE_KEY, NUM_KEY
from .links import LinkServer
from .options import engine_options, local_workers, nodes, size
from .packing import pack_block, unpack_outcome
from .stream import Receiver
from .taps import TapPlan, standard_patterns
from .views import PRESENTERS
from .watch import Proc, Watch


class VllmEngine(Engine):
    """Runs intervention blocks on a vLLM engine.

    :param model: a model folder (``save_pretrained`` layout) or name; default: the embedded tiny
        model.
    :param max_model_len: the longest prompt plus generation; every prompt is scheduled whole.
    :param kv_cache_gib: KV-cache size per worker (``kv_cache_memory_bytes``).
    :param vllm_logs: show vLLM's own logs and warnings (default: ``ASYNCPP_VLLM_LOGS``, else no:
        vLLM's errors only, and one progress line while the engine starts).
    :param block_budget: seconds each block's code may run per generation step; past that it is
        interrupted with a ``BlockTimeoutError`` that fails its own request only (default: no
        budget; not with ``tensor_parallel_size > 1``). Each resume of a block is timed (about
        a microsecond). Under pipeline parallelism each stage times its own part of a
        block: a block stopped on one stage fails there, and the others' pulls from it fail too.
    :param mode: ``"auto"`` (the default): vLLM's compiled model, and a request whose block's
        code names a location that is no tap runs its steps eagerly (with every request in those
        steps); ``"compiled"``: vLLM's compiled model only (on CPU dynamo and inductor, as a stock
        engine), where blocks are served at *taps* compiled into the graph (see ``taps``) and at
        the modules outside it (the top-level model, ``logits``, ``samples``), and awaiting any
        other location inside raises :class:`~asyncpp.TapError`; ``"eager"``: vLLM runs the
        model module by module and every location can be awaited.
    :param taps: module path patterns (``*`` within one name, ``**`` across names) of further
        taps on a compiled or auto engine, besides the default set: every direct child of the
        compiled model (the embeddings, each decoder layer, the final norm) and the attention and
        MLP of each layer (the standard view's points; on models whose embedding is not the
        stream, the first layer's arguments too). Taps serve outputs, a module's first argument
        for a pattern ending in ``.input``, all its arguments for ``.inputs``.
    :param standard_view: give blocks ``m.std``, the standard view (a model of a family without
        one fails here, naming what its tree lacks; False runs it with the raw tree only).
    :param node_timeout: on a multi-node engine (``nnodes > 1``; this engine is node 0, the
        others run :func:`~asyncpp.engines.vllm.run_node`: docs/scale-out.md), the seconds the
        start waits for every node; past it the start fails, naming what it waits for.
    :param vllm_options: passed to ``AsyncEngineArgs`` (``tensor_parallel_size``, ``dtype``,
        ``nnodes``, ``master_addr``, ...); asyncpp's defaults keep hooks correct: prefix caching
        and chunked prefill off.
    """

    supports_streaming = True
    streams_tokens = True

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        max_model_len: int = 512,
        kv_cache_gib: float = 1,
        vllm_logs: bool | None = None,
        block_budget: float | None = None,
        mode: str | None = None,
        taps: Sequence[str] = (),
        standard_view: bool = True,
        node_timeout: float = 300,
        **vllm_options: Any,
    ):
        console.refuse_in_spawned_child("asyncpp.VllmEngine(...)")
        self.vllm_logs = console.want_logs(vllm_logs)
        _check_budget(block_budget, vllm_options)
        self.block_budget = block_budget
        self.standard_view = standard_view
        built = engine_options(
            model,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib,
            vllm_logs=self.vllm_logs,
            mode=mode,
            taps=taps,
            **vllm_options,
        )
        options, patterns, default_model = built.options, built.patterns, built.default_model
        self.mode = built.mode
        if int(options.get("node_rank", 0) or 0) != 0:
            raise ValueError(
                f"node_rank={options['node_rank']}: VllmEngine is the head node (node_rank 0) of a "
                f"multi-node engine; start the other nodes with asyncpp.engines.vllm.run_node(...) "
                f"or `asyncpp serve --headless --node-rank N ...` (docs/scale-out.md)"
            )
        #: seconds the start waits for the other nodes of a multi-node engine (``nnodes > 1``)
        self.node_timeout = float(node_timeout)
        self.options = options
        self._closed = False
        self._dead: str | None = None  # why the engine is dead, once it is
        self._watch: Watch | None = None
        self._receiver: Receiver | None = None  # streamed values (made on the engine's loop)
        self._links: LinkServer | None = None  # a multi-node engine's links to its workers
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncpp-vllm", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        progress = console.Progress(
            console.describe(options, default_model, self.mode), own_line=self.vllm_logs
        )
        quiet = None if self.vllm_logs else console.StderrFilter()
        before = lifeline.children()
        self._abandoned = threading.Event()
        start = None
        try:
            with (
                start_errors.collecting() as reported,
                console.starting_env(self.vllm_logs, local_workers(options)),
                quiet.redirect() if quiet else contextlib.nullcontext(),
            ):
                # started inside: vLLM reads its logging level from the environment as it makes
                # the engine's config, at once when vLLM is already imported
                start = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
                try:
                    self._llm, entries, procs = self._starting(start, before)
                except Exception as e:
                    ours = reported()  # asyncpp's error in one of vLLM's processes, if that was it
                    if ours is None:
                        raise
                    ours.add_note("(raised in one of vLLM's processes while the engine started)")
                    raise ours from e
        except BaseException as e:
            progress.done("failed after")
            if start is not None and not isinstance(e, Exception):  # interrupted: vLLM's start
                self._abandon(start, before)  # goes on in the loop thread
            self._stop_loop()
            raise
        self._stderr = quiet  # forwards vLLM's processes' stderr for as long as they run
        self.tree = tree_from_paths([(p, t) for p, t in entries], ALIASES)
        if self._taps_info["standard_error"]:  # (and the engine was made with standard_view=False)
            standard.attach(self.tree, None, self._taps_info["standard_error"])
        else:
            standard.attach(self.tree, PRESENTERS, family=self._taps_info.get("family"))
        info = self._taps_info
        #: the tap set, as the driver sees it (None on an eager engine): which requests an auto
        #: engine runs eagerly (:meth:`runs_eagerly`), which waits a compiled one refuses at invoke
        self._plan = None
        #: the locations the tap set reached whose module's call cannot have a tap, each with why
        #: (left out: a pattern that names a module exactly fails the start instead)
        self.untappable: dict[str, str] = {}
        if info["compiled"]:
            paths = [p for p, _ in entries]
            self._plan = TapPlan(
                paths, [t for _, t in entries], info["roots"], [*standard_patterns(self.tree), *patterns]
            )
            self._plan.standard = self.tree.__dict__.get("_std")
            for i, k, why in info["dropped"]:
                self._plan.drop(i, k, why)
            self.untappable = self._plan.untappable
        #: the tap set of a compiled engine (module paths), empty on an eager one
        self.taps: list[str] = [p for p in info["taps"] if p not in self.untappable]
        #: seconds vLLM spent compiling the model at start (0 when eager, small from its cache)
        self.compile_seconds = float(info["compile_seconds"])
        #: whether the compiled model came from the compile cache (inductor's) instead of compiling
        self.compile_cached = bool(info["compile_cached"])
        self._max_prompt = int(getattr(self._llm.model_config, "max_model_len", max_model_len)) - 1
        self._watch = Watch(procs, self._on_death)
        self.tokenizer = _load_tokenizer(options["model"])
        atexit.register(self.close)  # vLLM's own teardown at interpreter exit is noisy
        #: seconds the engine took to start (vLLM's processes, weights, compilation)
        self.start_seconds = progress.done(
            f"compiled in {self.compile_seconds:.1f} s, ready in" if self.mode != "eager" else "ready in"
        )

    def wait_refusal(self) -> Callable[[int, int], Exception | None] | None:
        """On a ``"compiled"`` engine, the TapError of a wait its taps cannot serve (a trace
        raises it at invoke when the block's code is sure to make that wait); None elsewhere (an
        auto engine runs such a block eagerly, an eager one serves every location)."""
        if self.mode != "compiled" or self._plan is None:
            return None
        return self._plan.refuse

    def check_options(self, spec: RunSpec) -> None:
        """A trace's keyword arguments are vLLM ``SamplingParams``: refuse what vLLM would refuse,
        and what asyncpp sets itself (``max_tokens``, ``extra_args``, ``output_kind``, ``n``)."""
        sampling.check(spec)

    def runs_eagerly(self, block: Callable, args: tuple = (), kwargs: dict | None = None) -> bool:
        """Whether this engine runs a request with this block eagerly: on an auto engine, when
        the block's code names a location inside the compiled model that is no tap (or its code
        cannot be read that far); on an eager engine always, on a compiled one never."""
        if self.mode != "auto":
            return self.mode == "eager"
        plan = self._plan
        return plan is not None and plan.needs_eager(block_footprint(block, args, kwargs))

    # --- the engine's own loop ------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _starting(self, start: concurrent.futures.Future, before: set[int]) -> Any:
        # woken twice a second, so that a signal's handler (Ctrl-C) runs while vLLM starts
        n = nodes(self.options)
        deadline = time.monotonic() + self.node_timeout if n > 1 else None
        while not start.done():
            concurrent.futures.wait([start], timeout=0.5)
            if deadline is not None and time.monotonic() > deadline and not start.done():
                self._abandon(start, before)
                raise AsyncppError(self._nodes_missing(n))
        return start.result()

    def _nodes_missing(self, n: int) -> str:
        addr = self.options.get("master_addr")
        port = self.options.get("master_port") or 29501  # (vLLM's default)
        return (
            f"this multi-node engine (nnodes={n}) did not start within node_timeout="
            f"{self.node_timeout:g} s: vLLM waits for the workers of every node to join at "
            f"{addr}:{port}. Start nodes 1 to {n - 1} with asyncpp.engines.vllm.run_node(...) or "
            f"`asyncpp serve --headless --nnodes {n} --node-rank K --master-addr {addr} --master-port "
            f"{port} ...` with the same model and options, and check that they reach {addr}:{port} "
            f"(or give a slow start a larger node_timeout)"
        )

    def _abandon(self, start: concurrent.futures.Future, before: set[int]) -> None:
        """The start was interrupted (Ctrl-C; a server's SIGTERM) while vLLM's start goes on in the
        engine's thread: end the engine cores it makes until it gives up, or have it shut down
        the engine it has made."""
        self._abandoned.set()
        deadline = time.monotonic() + 60
        while not start.done() and time.monotonic() < deadline:
            lifeline.end_engine_cores(before)
            concurrent.futures.wait([start], timeout=0.2)

    async def _start(self) -> tuple[Any, list, list[Proc]]:
        _import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._died = asyncio.get_running_loop().create_future()
        stages = size(self.options, "pipeline_parallel_size")
        if nodes(self.options) > 1:  # the other nodes' workers connect over TCP
            from vllm.utils.network_utils import get_ip

            self._receiver = Receiver(stages, get_ip())
            self._links = LinkServer(get_ip(), self._receiver.secret, self._on_lost)
        else:
            self._receiver = Receiver(stages)
        try:
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.options))
        except BaseException:
            await self._close_channels()
            raise
        try:
            if self._abandoned.is_set():
                raise AsyncppError("the engine's start was interrupted")
            infos = await llm.collective_rpc("asyncpp_taps")
            self._taps_info = infos[0]
            dropped = {(i, k): why for info in infos for i, k, why in info["dropped"]}
            if dropped:  # every rank leaves out the taps any rank's trace found cannot be
                self._taps_info["dropped"] = [[i, k, why] for (i, k), why in sorted(dropped.items())]
                await llm.collective_rpc("asyncpp_drop_taps", args=(self._taps_info["dropped"],))
            if self._taps_info["error"]:
                raise ValueError(self._taps_info["error"])
            if self._taps_info["standard_error"] and self.standard_view:
                raise StandardViewError(
                    f"{self._taps_info['standard_error']}. VllmEngine(..., standard_view=False) runs "
                    f"it with the raw module tree only"
                )
            entries = (await llm.collective_rpc("asyncpp_tree"))[0]
            where = await llm.collective_rpc("asyncpp_where")
            link = None if self._links is None else self._links.address
            await llm.collective_rpc(
                "asyncpp_stream", args=(self._receiver.address, self._receiver.secret, link)
            )
            if self.block_budget is not None:
                await llm.collective_rpc("asyncpp_budget", args=(self.block_budget,))
        except BaseException:
            llm.shutdown()
            await self._close_channels()
            raise
        return llm, entries, self._procs(llm, where)

    async def _close_channels(self) -> None:
        """Close the stream channel and a multi-node engine's links (the headless nodes' workers
        then end their nodes)."""
        if self._links is not None:
            self._links.stop()
        if self._receiver is not None:
            await self._receiver.close()

    def _procs(self, llm: Any, where: list[dict[str, Any]]) -> list[Proc]:
        """vLLM's processes on this host (their pids mean something here): its workers (named
        by rank) and the engine core. A multi-node engine learns of the others' ends through
        their connections (:meth:`_on_lost`)."""
        here = lifeline.host_id()
        procs = []
        for rank, w in enumerate(where):
            if w["host"] == here:
                procs.append(
                    Proc(f"vLLM worker rank {rank}", int(w["pid"]), True, self._where(rank, w["node"]))
                )
        manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
        for proc in getattr(manager, "processes", None) or ():
            if proc.pid is not None:
                procs.append(Proc("vLLM's engine core", int(proc.pid), False))
        return procs

    # --- a dead engine --------------------------------------------------------------------------

    def _on_death(self, proc: Proc, status: str | None, why: str | None = None) -> None:
        """The watch thread: one of vLLM's processes ended while the engine was open (``why``
        says so, if the process is not one of this host's)."""
        if self._closed or self._dead is not None:
            return
        resources = getattr(getattr(self._llm, "engine_core", None), "resources", None)
        if getattr(resources, "engine_dead", False):
            # vLLM's engine core reported a failure first: it stops its workers itself
            why = "vLLM's engine core failed (vLLM logged the cause above)"
        else:
            if why is None:
                why = f"{proc.name} (pid {proc.pid}{proc.where}) died" + (f", {status}" if status else "")
            if proc.worker and self._watch is not None:
                self._watch.kill_workers(but=proc)
        self._dead = why
        self._loop.call_soon_threadsafe(self._mark_dead)

    def _on_lost(self, rank: int, peer: str) -> None:
        """The links' thread: the link of worker ``rank`` of a multi-node engine ended while the
        engine was open. A worker on this host is named by the watch, with how it ended: this
        waits a moment for it."""
        if self._closed or self._dead is not None:
            return

        def lost() -> None:
            if self._closed or self._dead is not None:
                return
            at = f" at {peer}" if peer else ""
            self._on_death(
                Proc(f"vLLM worker rank {rank}", 0, True),
                None,
                f"the link to vLLM worker rank {rank}{self._where(rank)}{at} was lost: the worker "
                f"or its node ended, or the network between the nodes failed",
            )

        timer = threading.Timer(1.0, lost)
        timer.daemon = True
        timer.start()

    def _where(self, rank: int, node: int | None = None) -> str:
        """``, pipeline stage S, tensor-parallel rank T, node N`` for worker ``rank``."""
        pp, tp = size(self.options, "pipeline_parallel_size"), size(self.options, "tensor_parallel_size")
        at = f", pipeline stage {rank // tp}, tensor-parallel rank {rank % tp}" if pp * tp > 1 else ""
        if nodes(self.options) > 1:
            at += f", node {rank // local_workers(self.options) if node is None else node}"
        return at

    def _mark_dead(self) -> None:
        if not self._died.done():
            self._died.set_result(None)

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(
            f"this VllmEngine is dead: {self._dead}. It cannot run traces any more: close it and "
            f"create a new VllmEngine"
        )

    async def _vllm_died(self, err: BaseException) -> EngineDeadError:
        """vLLM reported its engine dead before the watch saw a process end: give the watch a
        moment to name the process, else say what vLLM said."""
        if self._dead is None:
            await asyncio.wait((self._died,), timeout=1.0)
        if self._dead is None:
            self._dead = f"vLLM's engine core failed ({type(err).__name__}: {err})"
            self._mark_dead()
        return self._dead_error()

    async def _unless_dead(self, aw: Any) -> Any:
        """Await ``aw``, unless the engine dies first (then ``EngineDeadError`` at once); vLLM's
        own engine-dead error becomes asyncpp's."""
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait((task, self._died), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller gave up: cancel the work and let it unwind
            task.cancel()
            task.add_done_callback(_retrieve)
            await asyncio.wait((task,))
            raise
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)  # its outcome is the dead engine's: nobody reads it
            raise self._dead_error()
        try:
            return task.result()
        except Exception as err:
            if _is_engine_dead(err):
                raise await self._vllm_died(err) from None
            raise

    # --- Engine ---------------------------------------------------------------------------------

    def run(self, spec: RunSpec) -> RunOutcome:
        self._check_open()
        return self._call(self._run(spec))

    async def run_async(self, spec: RunSpec) -> RunOutcome:
        self._check_open()
        return await await_future(asyncio.run_coroutine_threadsafe(self._run(spec), self._loop))

    def submit(
        self, spec: RunSpec, post: Callable[..., Any], settle: Callable[[bool, Any], None]
    ) -> Callable[[], Any]:
        """Start the run on the engine's loop (values reach ``spec.sink`` as they come); when it
        has ended, ``post(settle, ok, outcome or error)``. Returns a function that abandons the run
        (its requests are aborted in vLLM)."""
        self._check_open()
        fut = asyncio.run_coroutine_threadsafe(self._run(spec), self._loop)

        def done(f: Any) -> None:
            if f.cancelled():
                ok, value = False, asyncio.CancelledError()
            elif f.exception() is not None:
                ok, value = False, f.exception()
            else:
                ok, value = True, f.result()
            with contextlib.suppress(RuntimeError):  # the caller's loop has closed
                post(settle, ok, value)

        fut.add_done_callback(done)
        return fut.cancel

    # --- for code that serves the engine's requests itself (asyncpp.serve's OpenAI routes) ------

    @property
    def async_llm(self) -> Any:
        """vLLM's ``AsyncLLM`` this engine runs; it lives on :attr:`loop` (call its coroutines
        there). ``None`` once the engine is closed."""
        return self._llm

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The engine's own event loop (in a thread of its own), where its ``AsyncLLM`` runs."""
        return self._loop

    def new_request_number(self) -> int:
        """A number for a new request, unique in this engine (pipeline stages key buffers by it)."""
        return next(self._ids)

    async def caught_up(self, stream: Any, tokens: int) -> None:
        """On the engine's loop: wait until every value the steps that sampled a request's first
        ``tokens`` tokens emitted is delivered. Await it before passing on the request's new
        output, so that a step's values come before its token (the request must have been sent
        live: ``LIVE_KEY`` in its ``extra_args``)."""
        await self._receiver.caught_up(stream, tokens)

    def open_stream(self, aid: str, sink: Callable[[int, Any], None] | None) -> Any:
        """On the engine's loop: follow request ``aid``'s streamed values (``sink(0, value)`` as
        each arrives) and its end; :meth:`settle` waits for it, :meth:`drop_stream` forgets it."""
        return self._receiver.open(aid, sink, 0)

    def drop_stream(self, aid: str) -> None:
        """On the engine's loop: forget request ``aid``'s stream."""
        self._receiver.drop(aid)

    @property
    def dead(self) -> bool:
        """Whether one of vLLM's processes has died: every trace then fails at once."""
        return self._dead is not None

    def close(self) -> None:
        """Shut vLLM down (its processes exit) and stop the engine's thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._watch is not None:
            self._watch.stop()

        async def shutdown(llm: Any) -> None:
            try:
                # let vLLM's processes stop by themselves (no forced kill), unless one has died:
                # the engine core may be waiting on it, and would use the whole grace period
                llm.shutdown(timeout=60 if self._dead is None else 5)
            finally:
                await self._close_channels()

        try:
            self._call(shutdown(self._llm))
        finally:
            self._llm = None  # AsyncLLM's own __del__ at interpreter exit is noisy: collect it now
            gc.collect()
            self._stop_loop()

    def set_block_budget(self, seconds: float | None) -> None:
        """Change the time budget of blocks (see ``block_budget``; ``None``: none) for the runs
        that start after this."""
        self._check_open()
        _check_budget(seconds, self.options)

        async def send() -> Any:
            return await self._unless_dead(self._llm.collective_rpc("asyncpp_budget", args=(seconds,)))

        self._call(send())
        self.block_budget = seconds

    def worker_stats(self) -> list[dict[str, int]]:
        """Per-request state each worker holds now (requests, blocks, waits...), for leak checks."""
        self._check_open()

        async def stats() -> Any:
            return await self._unless_dead(self._llm.collective_rpc("asyncpp_stats"))

        return self._call(stats())

    def eager_steps(self) -> list[int]:
        """How many engine steps each worker has run eagerly so far (an auto engine's steps that
        held a request needing eager; every step on an eager engine is not counted: 0)."""
        self._check_open()

        async def counts() -> Any:
            return await self._unless_dead(self._llm.collective_rpc("asyncpp_eager_steps"))

        return self._call(counts())

    def worker_trees(self) -> list[list[tuple[str, str]]]:
        """Every worker's own module tree as (path, type name) in ``named_modules()`` order, in rank
        order (on a pipeline-parallel engine, with the full architecture grafted under each stage's
        placeholders, every rank's equals the one-stage model's)."""
        self._check_open()

        async def trees() -> Any:
            return await self._unless_dead(self._llm.collective_rpc("asyncpp_tree", args=(True,)))

        return [[(p, t) for p, t in tree] for tree in self._call(trees())]

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def _check_open(self) -> None:
        if self._closed:
            raise AsyncppError("this VllmEngine is closed")
        if self._dead is not None:
            raise self._dead_error()

    # --- one trace ------------------------------------------------------------------------------

    async def _run(self, spec: RunSpec) -> RunOutcome:
        from vllm import SamplingParams

        invokes = spec.invokes
        prompts = []
        for i, inv in enumerate(invokes):
            where = f"invoke #{i} ({inv.name})"
            if inv.input is None:
                raise InputError(f"{where}: on vLLM every invoke is a request and needs a prompt")
            rows = token_rows(inv.input, self.tokenizer, where)
            if len(rows) != 1:
                raise InputError(f"{where}: one prompt per invoke on vLLM (got {len(rows)} rows)")
            if not rows[0]:
                raise InputError(f"{where}: the prompt is empty; give it at least one token")
            if len(rows[0]) > self._max_prompt:
                raise InputError(
                    f"{where}: the prompt has {len(rows[0])} tokens, but this engine's "
                    f"max_model_len={self._max_prompt + 1} leaves room for at most {self._max_prompt} "
                    f"(a request must be able to generate at least one token). Shorten the prompt, or "
                    f"create the VllmEngine with a larger max_model_len"
                )
            prompts.append(rows[0])
        nums = [next(self._ids) for _ in invokes]
        ids = [f"asyncpp-{n}-{uuid.uuid4().hex[:8]}" for n in nums]
        options = sampling.request_options(spec.model_kwargs, streams_tokens=spec.token_sink is not None)
        max_tokens = spec.max_new_tokens if spec.generate else 1
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                **options,
                extra_args={
                    EXTRA_KEY: pack_block(inv.block, inv.args, inv.kwargs),
                    ID_KEY: rid,
                    NUM_KEY: num,
                    **({EAGER_KEY: True} if self.runs_eagerly(inv.block, inv.args, inv.kwargs) else {}),
                    **({LIVE_KEY: True} if spec.token_sink is not None else {}),
                },
            )
            for inv, rid, num in zip(invokes, ids, nums)
        ]
        llm = self._llm
        receiver = self._receiver
        streams = [receiver.open(rid, spec.sink, i) for i, rid in enumerate(ids)]
        try:
            # one watch on the engine's life for the whole run (each costs a task and a wait)
            return await self._unless_dead(
                self._requests(llm, prompts, params, ids, streams, spec.token_sink)
            )
        finally:
            for rid in ids:
                receiver.drop(rid)

    async def _requests(
        self,
        llm: Any,
        prompts: list,
        params: list,
        ids: list[str],
        streams: list,
        token_sink: Callable[[int, list[int]], None] | None = None,
    ) -> RunOutcome:
        from vllm.inputs import tokens_input

        receiver = self._receiver

        async def one(i: int, prompt: list[int], sp: Any, rid: str) -> Any:
            final = None
            sent = 0
            async for out in llm.generate(tokens_input(prompt), sp, request_id=rid):
                final = out
                if token_sink is not None and out.outputs:
                    ids_now = out.outputs[0].token_ids
                    if len(ids_now) > sent:
                        # the values the steps that sampled these tokens emitted go first
                        await receiver.caught_up(streams[i], len(ids_now))
                        token_sink(i, [int(x) for x in ids_now[sent:]])
                        sent = len(ids_now)
            return final

        try:
            if len(prompts) == 1:  # (no task of its own)
                try:
                    finals = [await one(0, prompts[0], params[0], ids[0])]
                except Exception as err:
                    finals = [err]
            else:
                finals = await asyncio.gather(
                    *(one(i, p, sp, r) for i, (p, sp, r) in enumerate(zip(prompts, params, ids))),
                    return_exceptions=True,
                )
        except BaseException:
            await self.collect_early(ids)  # the caller gave up: the workers drop the requests
            raise
        lost = [rid for rid, final in zip(ids, finals) if isinstance(final, BaseException)]
        if lost and not any(_is_engine_dead(f) for f in finals):
            await self.collect_early(lost)
        if self._dead is not None:  # it died as the requests ended: their blocks' outcomes are lost
            raise self._dead_error()
        for final in finals:
            if _is_engine_dead(final):
                raise await self._vllm_died(final)
        await self._receiver.ended(streams)  # (inside _run's watch on the engine's life)
        outcomes = self._outcomes(streams)
        outcome = RunOutcome([])
        for i, final in enumerate(finals):
            o = InvokeOutcome()
            o.result, o.error = outcomes[i]
            o.emitted = streams[i].values
            if isinstance(final, BaseException):
                o.error = final  # vLLM refused or lost the request: its own error says why
            elif final is not None:
                o.output = final
                o.tokens = torch.tensor([list(final.outputs[0].token_ids)], dtype=torch.long)
            outcome.invokes.append(o)
        outcome.output = [o.output for o in outcome.invokes]
        return outcome

    async def settle(self, streams: list[Any]) -> list[tuple[Any, BaseException | None]]:
        """On the engine's loop: each request's (result, error), once the workers have sent its
        end (which carries its block's outcome; the end of a request comes the engine step after its
        last output, without a round trip to the workers between steps)."""
        await self._unless_dead(self._receiver.ended(streams))
        return self._outcomes(streams)

    def _outcomes(self, streams: list[Any]) -> list[tuple[Any, BaseException | None]]:
        out = []
        for stream in streams:
            result, error = self._outcome(stream.outcomes)
            if error is None and stream.error is not None:
                error = stream.error
            out.append((result, error))
        return out

    async def collect_early(self, ids: list[str]) -> None:
        """Finish requests that will not run to their end now (their caller gave up, or vLLM
        refused or failed them): the workers drop their state and send their ends. Shielded: it
        runs to its end also when the caller is cancelled."""
        if self._dead is not None:
            return
        waiting = [rid for rid in ids if not self._receiver.has_ended(rid)]
        if not waiting:
            return
        collect = self._unless_dead(self._llm.collective_rpc("asyncpp_collect", args=(waiting,)))
        await asyncio.shield(asyncio.ensure_future(collect))

    def _outcome(self, packed: list[bytes | None]) -> tuple[Any, BaseException | None]:
        """One request's outcome from every pipeline stage's (sent by TP rank 0 of each): the one
        stage's, or the stages' results merged. The first stage's error wins, except that a
        failed pull loses to the error that ended the request on the stage it pulled from."""
        if len(packed) == 1:
            return unpack_outcome(packed[0])
        stages = [unpack_outcome(p) for p in packed]
        errors = [error for _, error in stages if error is not None]
        if errors:
            causes = [e for e in errors if not isinstance(e, PullError)]
            return None, (causes or errors)[0]
        merged = merge([r for r, _ in stages])
        return (None if merged is NOT_HERE else merged), None


def _check_budget(seconds: float | None, options: dict[str, Any]) -> None:
    if seconds is None:
        return
    StepBudget.check(seconds)
    if size(options, "tensor_parallel_size") > 1:
        raise ValueError(
            "block_budget is not supported with tensor_parallel_size > 1: every rank runs every "
            "block and must make the same decisions, but each rank's clock could stop a block at a "
            "different line, and the other ranks would then wait for it in a collective. Leave "
            "block_budget unset on tensor-parallel engines"
        )


def _import_vllm() -> None:
    """Import vLLM in a thread of its own. Something vLLM keeps from its import holds on to the
    import's frames, and with them to the frame that imported it: imported in ``_start``, the
    ``AsyncLLM`` there stayed alive after ``close``, to be shut down noisily at interpreter exit."""
    if "vllm.v1.engine.async_llm" in sys.modules:
        return

    def load() -> None:
        try:
            import vllm.engine.arg_utils  # noqa: F401
            import vllm.v1.engine.async_llm  # noqa: F401
        except Exception:
            pass  # imported again in the caller's thread, which gets the error

    thread = threading.Thread(target=load, name="asyncpp-vllm-import")
    thread.start()
    thread.join()


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _is_engine_dead(err: Any) -> bool:
    """vLLM's own engine-dead error (its engine core is gone or failed)."""
    if not isinstance(err, BaseException):
        return False
    try:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead
    except ImportError:  # pragma: no cover - another vLLM layout
        return type(err).__name__ == "EngineDeadError"
    return isinstance(err, VllmEngineDead)


def _load_tokenizer(model: str) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    except Exception:
        return None
