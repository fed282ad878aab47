"""asyncpp's vLLM worker: runs every request's block inside the worker's model execution.

vLLM builds this class by its dotted name in each worker process (``worker_cls``). After the model
is loaded, the controllers are installed on every module of the model and on the runner's sampler,
for good, and one long-lived interleaver serves all requests:

* a request's block is **started** at the first forward that includes the request (its rows known,
  the forward's torch state, inference mode, as its initial state);
* it is **stepped** by the controllers during each forward, seeing its own token rows of model
  modules and its own row of ``logits`` and ``samples``; each forward its request takes part in is
  one generation step of its own;
* it is **finished** when vLLM reports the request finished (the step after its last output, or
  its abort), and every trace of it is dropped; its packed outcome goes to the driver on the
  stream channel with the request's end. Only a request whose caller gave up or that vLLM failed
  is finished early, by the driver's ``asyncpp_collect``.

What a block streams (``asyncpp.emit``) is sent to the driver at once, from inside the forward, by
tensor-parallel rank 0 of each stage (see ``stream.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from ...kernel.block import Block
from ...kernel.budget import StepBudget
from ...kernel.errors import AsyncppError
from ...kernel.hooks import RunHooks
from ...kernel.interleaver import Interleaver
from ...locations import standard
from ...locations.tree import build_tree, tree_from_paths
from ...native import tls
from ...native.controllers import Controllers
from ...pp.ownership import Ownership, report
from ...pp.pulls import PullService
from ...pp.stage import StageSession
from . import backend, lifeline, taps
from .full_model import GraftCost, graft_full_model
from .keys import ALIASES, EAGER_KEY, EXTRA_KEY, ID_KEY, LIVE_KEY, NUM_KEY
from .links import hold_link
from .packing import pack_outcome, unpack_block
from .start_errors import reported
from .stream import Sender
from .tensor_parallel import find_shardings
from .views import PRESENTERS, head_of

log = logging.getLogger("asyncpp.vllm")

CLOSE_GRACE_S = 3.0  # how long a closing stage waits for its peers' goodbyes (vLLM's shutdown waits)


class AsyncppWorker(CPUWorker):
    """vLLM's CPU worker with asyncpp's controllers and interleaver."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # vLLM's multiprocessing executor starts its workers from the engine core (or a headless
        # node's process); any other executor (Ray) manages its workers' lives itself
        multiproc = self.vllm_config.parallel_config.distributed_executor_backend == "mp"
        lifeline.watch_driver(parent_is_engine=multiproc)
        if multiproc:
            lifeline.watch_parent()

    @reported
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        _quiet_warnings()
        out = super().load_model(*args, **kwargs)
        _stack_dumps()
        self.asyncpp = WorkerSession(self.model_runner)
        return out

    def shutdown(self) -> None:
        session = getattr(self, "asyncpp", None)
        try:
            if session is not None:
                session.close()
        finally:
            super().shutdown()

    @reported
    def determine_available_memory(self) -> int:
        # on a compiled engine this first forward traces and compiles the model (vLLM's warm-up)
        start = time.perf_counter()
        counts = _compile_cache_counts()
        try:
            return super().determine_available_memory()
        finally:
            self.asyncpp.warmup_seconds = time.perf_counter() - start
            hits, misses = (b - a for a, b in zip(counts, _compile_cache_counts(), strict=True))
            self.asyncpp.compile_cached = hits > 0 and misses == 0

    @reported
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        return super().compile_or_warm_up_model(*args, **kwargs)

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        session = self.asyncpp
        session.before_step(scheduler_output)
        if not session.eager_requests or not session.eager_step(scheduler_output):
            out = super().execute_model(scheduler_output, *args, **kwargs)
        else:
            with session.running_eagerly():
                out = super().execute_model(scheduler_output, *args, **kwargs)
        if session.live:
            session.after_forward(scheduler_output, sampled_later=out is None)
        return out

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = super().sample_tokens(*args, **kwargs)
        if self.asyncpp.unmarked:
            self.asyncpp.mark_step()
        return out

    # --- called by the driver through collective_rpc (between engine steps) ---------------------

    def asyncpp_tree(self, local: bool = False) -> list[list[str]]:
        """The model's module tree as [path, type name] pairs, in index order: the tree blocks
        resolve against, or with ``local`` this worker's own ``named_modules()`` (placeholders
        named by the type of the module they stand for)."""
        return self.asyncpp.tree_entries(local)

    def asyncpp_collect(self, ids: list[str]) -> None:
        """Finish these requests' blocks now (their outcomes go on the stream channel) and forget
        them: for requests that will not run to their end (their caller gave up, vLLM failed them)."""
        self.asyncpp.collect(ids)

    def asyncpp_stats(self) -> dict[str, int]:
        """How much per-request state this worker holds (for leak checks)."""
        return self.asyncpp.stats()

    def asyncpp_stream(self, address: str, secret: str | None = None, link: str | None = None) -> bool:
        """Connect to the driver's channel for streamed values; whether this rank sends on it. A
        multi-node engine's also give its ``secret`` and the address of the driver's links (see
        ``links.py``)."""
        return self.asyncpp.connect(address, secret, link)

    def asyncpp_where(self) -> dict[str, Any]:
        """Where this worker runs: its pid, its host (:func:`lifeline.host_id`) and its node."""
        return {
            "pid": os.getpid(),
            "host": lifeline.host_id(),
            "node": int(self.vllm_config.parallel_config.node_rank or 0),
        }

    def asyncpp_eager_steps(self) -> int:
        """How many steps this worker has run eagerly on an auto engine."""
        return self.asyncpp.eager_steps

    def asyncpp_taps(self) -> dict[str, Any]:
        """Whether this worker runs vLLM's compiled model, its taps, and the compile time."""
        return self.asyncpp.taps_info()

    def asyncpp_drop_taps(self, dropped: list[list[Any]]) -> None:
        """Leave out the taps, [site, kind, why] each, that any rank's trace found cannot be."""
        self.asyncpp.drop_taps(dropped)

    def asyncpp_budget(self, seconds: float | None) -> None:
        """Give every block a time budget per generation step (None: none)."""
        self.asyncpp.set_budget(seconds)


class _Request:
    __slots__ = ("aid", "num", "payload", "block", "outcome", "error", "emitted", "eager", "live", "steps")

    def __init__(self, aid: str, payload: bytes, num: int = 0, eager: bool = False, live: bool = False):
        self.aid = aid
        self.num = num
        self.eager = eager  # (auto mode) the steps it is in run eagerly
        self.live = live  # its caller follows its tokens as they are sampled: each step is marked
        self.steps = 0  # (live) the steps it has been in
        self.payload = payload
        self.emitted = 0  # values its block has streamed (asyncpp.emit)
        self.block: Block | None = None
        self.outcome: bytes | None = None  # packed, once the block is finished
        self.error: BaseException | None = None  # a failure before the block could start


class WorkerSession:
    """The per-worker state: controllers, the interleaver, and the requests that carry blocks."""

    def __init__(self, runner: Any):
        self.runner = runner
        model = runner.model
        self.stage = None  # the pipeline stage's session (pipeline parallel engines only)
        self.of_block: dict[int, _Request] = {}  # id(block) -> its request
        self._starting: _Request | None = None  # the request whose block is starting
        self.sender = Sender()
        self.link: Any = None  # a multi-node engine's link to the driver (links.py)
        self.local_tree: list[tuple[str, str]] | None = None
        self.graft_cost: GraftCost | None = None
        self.warmup_seconds = 0.0  # vLLM's warm-up forward (compiles the model on compiled engines)
        self.compile_cached = False  # whether that compile came from inductor's cache
        # the standard view's family where the root's class does not say it (backend models)
        self.family = backend.family(model, runner.vllm_config.model_config.hf_config)
        pipeline = _pipeline(runner)
        if pipeline is None:
            self.tree, modules, self.paths = build_tree(model, ALIASES, {"sampler": runner.sampler})
        else:
            ownership, modules = pipeline.ownership, pipeline.modules
            self.local_tree, self.graft_cost = pipeline.local, pipeline.cost
            self.tree, self.paths = tree_from_paths(ownership.entries, ALIASES), ownership.paths
        try:
            self.std_error: str | None = None
            standard.attach(self.tree, PRESENTERS, head=head_of(model), family=self.family)
        except standard.StandardViewError as err:  # the driver decides whether that is fatal
            self.std_error = str(err)
            standard.attach(self.tree, None, self.std_error)
        self.plan = self._tap_plan(model)
        self.eager_requests = 0  # live requests that run their steps eagerly (auto mode)
        self.eager_steps = 0  # steps this worker ran eagerly on a compiled engine
        self.live = 0  # requests whose caller follows their tokens live (see mark_step)
        self.unmarked: deque[Any] = deque()  # (live) forwards whose sampling is still to come
        # (op, CPU kernel, compiled-mode method) of the compiled model's vLLM custom ops, once the
        # first eager step has given those modules controllers
        self._eager_ops: list[tuple[Any, Any, Any]] | None = None
        self._modules = modules
        controlled = modules
        arg_names: dict[int, tuple[str, ...]] = {}
        if self.plan is not None:  # compiled: inside the graph, taps instead of controllers
            inside = self.plan.inside
            controlled = [None if i in inside else m for i, m in enumerate(modules)]
            arg_names = taps.tap_modules(modules, self.paths, self.plan)
        self.controllers = Controllers(controlled)
        adapt_out, adapt_in = backend.batch_dim_adapters(
            model, modules, self.paths, self._tokens, find_shardings(modules, self.paths)
        )
        hooks = RunHooks(
            on_step=self._on_step,
            on_emit=self._on_emit,
            request_level=frozenset(
                i for i, p in enumerate(self.paths) if _under(p, "logits_processor") or _under(p, "sampler")
            ),
            adapt_out=adapt_out,
            adapt_in=adapt_in,
            # the sampler edits the logits in place (temperature): blocks keep what they were served
            copy_after=frozenset(i for i, p in enumerate(self.paths) if p == "logits_processor"),
            refuse=None if self.plan is None else self.plan.refuse,
            refuse_at=frozenset() if self.plan is None else self.plan.guarded,
        )
        if pipeline is not None:
            self.stage = StageSession(ownership, pipeline.stage, pipeline.service, self._num_of)
            hooks = hooks.with_(**self.stage.hooks())
            log.info(ownership.describe(pipeline.stage))
        kernel = Interleaver(
            self.paths, 0, step_index=0, hooks=hooks, switch=tls.get_switch(), link=self.controllers.link
        )
        if self.stage is not None:
            self.stage.attach(kernel)
        self.kernel = kernel
        self.requests: dict[str, _Request] = {}  # vLLM request id -> request with a block
        self.stepping: dict[str, _Request] = {}  # those whose block is yet to start or to return
        self.by_aid: dict[str, str] = {}  # caller id -> vLLM request id
        self._order = 0
        self.controllers.install(kernel)  # for good: this process runs nothing else
        if self.plan is not None:
            taps.bind(kernel, self.controllers, self.plan.sites, arg_names)
        kernel.activate_here()  # (the worker's thread: blocks find their kernel, as in a local run)
        if self.stage is not None:
            self._serve_points(model, runner.sampler, modules)
        if self.plan is not None and self.plan.auto:
            model.register_forward_pre_hook(self._skip_compiled)

    def _tokens(self) -> int:
        """The token rows of the step being run."""
        return self.kernel.batch_size

    def _tap_plan(self, model: Any) -> taps.TapPlan | None:
        """On a compiled engine: which modules run inside vLLM's graph, and the taps among them
        (the default set and the engine's patterns, passed in vLLM's ``additional_config``)."""
        config = self.runner.vllm_config
        from vllm.config import CompilationMode

        if config.compilation_config.mode == CompilationMode.NONE:
            return None
        roots = taps.compiled_roots(model)
        if not roots:
            return None
        ours = (getattr(config, "additional_config", None) or {}).get(EXTRA_KEY) or {}
        types = [self.tree.find(p).module_type for p in self.paths]
        patterns = [*taps.standard_patterns(self.tree), *(ours.get("taps") or ())]
        plan = taps.TapPlan(self.paths, types, roots, patterns, auto=bool(ours.get("auto")))
        # vLLM's compile-cache key: the taps themselves, not the patterns that chose them (so that
        # a pattern naming nothing fails fast, from the cache, and equal tap sets share an entry)
        config.additional_config[EXTRA_KEY] = {"taps": plan.tap_paths, "taps_version": taps.TAPS_VERSION}
        log.info("compiled model %s; taps: %s", ", ".join(roots), plan.describe())
        return plan

    def taps_info(self) -> dict[str, Any]:
        plan = self.plan
        if plan is not None:  # (vLLM has traced the model by now)
            self.drop_taps([[i, k, why] for (i, k), why in taps.dropped().items()])
        return {
            "compiled": plan is not None,
            "taps": [] if plan is None else plan.tap_paths,
            "dropped": [] if plan is None else [[i, k, why] for (i, k), why in plan.dropped.items()],
            "roots": [] if plan is None else plan.roots,
            "error": None if plan is None else plan.error(),
            "compile_seconds": self.warmup_seconds if plan is not None else 0.0,
            "compile_cached": self.compile_cached,
            "standard_error": self.std_error,
            "family": self.family,
        }

    def drop_taps(self, dropped: list[list[Any]]) -> None:
        """Leave out these taps, [site, kind, why] each: the ones vLLM's trace found its modules'
        calls cannot have, on any rank (a pipeline's stages trace different layers)."""
        for i, k, why in dropped:
            if (i, k) not in self.plan.dropped:
                self.plan.drop(i, k, why)

    def _serve_points(self, model: Any, sampler: Any, modules: list[Any]) -> None:
        """The non-blocking serve points: after the stage's forward (the root's forward hook,
        after its output was served) and before the logits and the samples are offered (pre-hooks
        on the logits processor and the sampler, which run on the last stage only). With nothing
        parked each costs one check."""
        stage = self.stage

        def serve_point(*_: Any) -> None:
            if stage.parked:
                stage.poll()

        model.register_forward_hook(serve_point)
        logits = modules[self.paths.index("logits_processor")] if "logits_processor" in self.paths else None
        for module in (logits, sampler):
            if module is not None:
                module.register_forward_pre_hook(serve_point)

    # --- eager steps on an auto engine -----------------------------------------------------------

    def eager_step(self, so: Any) -> bool:
        """Whether a request of this step runs eagerly (every rank decides alike: from the
        scheduler's output)."""
        requests = self.requests
        for rid in so.num_scheduled_tokens:
            req = requests.get(rid)
            if req is not None and req.eager and (req.block is None or not req.block.done):
                return True  # (a block that has returned waits on nothing again)
        return False

    @contextlib.contextmanager
    def running_eagerly(self) -> Iterator[None]:
        """This step's forward runs the model's Python code (vLLM's ``skip_compiled``), served by
        controllers on every module, as on an eager engine; the taps stand aside."""
        plan = self.plan
        if self._eager_ops is None:
            # shadowed only now: vLLM traced these modules' forwards when it compiled the model
            inside = [(i, m) for i, m in enumerate(self._modules) if i in plan.inside and m is not None]
            self.controllers.extend(inside)
            self._eager_ops = _native_kernels(m for _, m in inside)
        plan.eager_now = True
        plan.guarded.clear()  # (the native fast path parks every wait again)
        for op, kernel, _ in self._eager_ops:
            op._forward_method = kernel
        self.eager_steps += 1
        try:
            with taps.standing_aside():
                yield
        finally:
            for op, _, compiled in self._eager_ops:
                op._forward_method = compiled
            plan.eager_now = False
            plan.guarded.update(plan.refuse_at)

    def _skip_compiled(self, *_: Any) -> None:
        if self.plan.eager_now:
            from vllm.forward_context import get_forward_context

            get_forward_context().skip_compiled = True

    def tree_entries(self, local: bool = False) -> list[list[str]]:
        if local and self.local_tree is not None:
            return [[p, t] for p, t in self.local_tree]
        return [[p, self.tree.find(p).module_type] for p in self.paths]

    # --- engine steps ---------------------------------------------------------------------------

    def before_step(self, so: Any) -> None:
        """Note the step's new requests (their blocks start with the forward) and finish the
        blocks of requests vLLM reports finished."""
        for new in so.scheduled_new_reqs:
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            payload = extra.get(EXTRA_KEY)
            if payload is None:
                continue
            aid = str(extra.get(ID_KEY, new.req_id))
            eager = self.plan is not None and bool(extra.get(EAGER_KEY))
            live = bool(extra.get(LIVE_KEY))
            req = self.requests[new.req_id] = _Request(aid, payload, int(extra.get(NUM_KEY, 0)), eager, live)
            self.stepping[new.req_id] = req
            self.eager_requests += eager
            self.live += live
            self.by_aid[aid] = new.req_id
            prompt = len(new.prompt_token_ids or ())
            scheduled = so.num_scheduled_tokens.get(new.req_id, 0)
            if new.num_computed_tokens > 0:
                req.error = RuntimeError(
                    f"vLLM took the first {new.num_computed_tokens} of the prompt's {prompt} tokens "
                    f"from its prefix cache and did not compute them; asyncpp presents a prompt to a "
                    f"block whole, so this request's block was not run. Keep enable_prefix_caching "
                    f"off (asyncpp's default)"
                )
            elif new.num_computed_tokens + scheduled < prompt:
                req.error = RuntimeError(
                    f"vLLM scheduled only {scheduled} of the prompt's {prompt} tokens in one step; "
                    f"asyncpp presents a prompt to a block whole, so this request's block was not run. "
                    f"Keep chunked prefill off, long_prefill_token_threshold at 0 and "
                    f"max_num_batched_tokens at least as long as the longest prompt"
                )
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        if resumed:
            for rid in sorted(resumed):  # a set: the same order on every rank
                req = self.requests.get(rid)
                if req is not None and req.block is not None and not req.block.done:
                    self._stop(rid, req, so.num_scheduled_tokens.get(rid, 0))
        finished = [rid for rid in so.finished_req_ids if rid in self.requests]
        if finished:
            with self.sender.hold():
                for rid in sorted(finished):  # a set: the same order on every rank
                    self._finish(rid)
        if self.stage is not None:
            self.stage.serve()  # a serve point: the previous round has been sent on

    def _stop(self, rid: str, req: _Request, tokens: int) -> None:
        """vLLM preempted the request (the KV cache was full) and now computes its tokens again:
        the recomputation would not hold what its block wrote before, and a block cannot run its
        steps twice, so the block is closed (its ``finally`` runs) and the request fails."""
        block = req.block
        block.error = RuntimeError(
            f"vLLM preempted this request (its KV cache was needed for other requests) and computes "
            f"its {tokens} tokens again; that recomputation would not hold what the block wrote, so "
            f"the block was stopped. Give the engine more KV cache (kv_cache_gib) or fewer requests "
            f"at once (max_num_seqs)"
        )
        self.kernel.forget(block)
        self.stepping.pop(rid, None)

    def after_forward(self, so: Any, sampled_later: bool) -> None:
        """(Live requests only) the step's forward is done: mark it now, or after its sampling
        (``sample_tokens``), where blocks may still run and emit."""
        self.unmarked.append(so)
        if not sampled_later:
            self.mark_step()

    def mark_step(self) -> None:
        """Tell the driver, on the stream channel, how many steps each live request of the oldest
        unmarked step has run: everything those steps emitted was sent before, on the same FIFO
        socket, so the driver passes a token on only once the step that sampled it is marked.
        (Emitted values travel on a socket of their own, the tokens through vLLM's engine core;
        without the mark a token could overtake its step's values.)"""
        so = self.unmarked.popleft()
        requests = self.requests
        marks = []
        for rid in so.num_scheduled_tokens:
            req = requests.get(rid)
            if req is not None and req.live:
                req.steps += 1
                marks.append((req.aid, req.steps))
        if marks:
            self.sender.mark(marks)

    def _on_step(self, step: int) -> list[Block]:
        """At the start of each forward: every request's rows, and its block started if new."""
        runner = self.runner
        batch = runner.input_batch
        n = batch.num_reqs
        starts = runner.query_start_loc.np[: n + 1].tolist()  # (Python ints: numpy's cost per item)
        self.kernel.set_batch(starts[n], n)
        active: list[Block] = []
        stepping = self.stepping
        if not stepping:  # plain requests, or blocks that have all returned: nothing to place
            return active
        index = batch.req_id_to_index
        over = []
        for rid, req in stepping.items():  # (in the order the requests came: the same on every rank)
            i = index.get(rid)
            if i is None or i >= n:  # not in this step
                continue
            if req.error is not None:
                over.append(rid)
                continue
            rows = (starts[i], starts[i + 1])
            block = req.block
            if block is None:
                block = self._start(req, rows, (i, i + 1))
                if block is None:
                    over.append(rid)
                    continue
            elif block.done:  # (it returned: nothing of it runs again)
                over.append(rid)
                continue
            else:
                block.rows, block.req_rows = rows, (i, i + 1)
            active.append(block)
        for rid in over:
            del stepping[rid]
        return active

    def _start(self, req: _Request, rows: tuple[int, int], req_rows: tuple[int, int]) -> Block | None:
        try:
            fn, args, kwargs = unpack_block(req.payload)
            coro = fn(self.tree, *args, **kwargs)
        except Exception as err:
            req.error = err
            return None
        req.payload = b""
        self._order += 1
        self._starting = req  # the block's first steps run inside start()
        try:
            block = self.kernel.start(
                coro, self._order, rows, name=getattr(fn, "__qualname__", "block"), req_rows=req_rows
            )
        finally:
            self._starting = None
        req.block = block
        self.of_block[id(block)] = req
        return block

    def _request_of(self, block: Block) -> _Request | None:
        return self.of_block.get(id(block), self._starting)

    def _num_of(self, block: Block) -> int:
        req = self._request_of(block)
        return 0 if req is None else req.num

    def set_budget(self, seconds: float | None) -> None:
        """Time each block's code per step (``kernel.budget``): past ``seconds`` it is interrupted
        with a BlockTimeoutError that fails its request only (the native fast path times its
        resumes through the kernel too)."""
        kernel = self.kernel
        if kernel.budget is not None:
            kernel.budget.close()
            kernel.budget = None
        if seconds is not None:
            kernel.budget = StepBudget(seconds)

    # --- streamed values ------------------------------------------------------------------------

    def connect(self, address: str, secret: str | None = None, link: str | None = None) -> bool:
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        sends = get_tp_group().rank_in_group == 0
        self.sender.connect(address, get_pp_group().rank_in_group, sends, secret)
        if link is not None and secret is not None and self.link is None:
            # on a headless node, a lost link means the head node has closed or is gone
            headless = int(self.runner.vllm_config.parallel_config.node_rank or 0) > 0
            self.link = hold_link(link, secret, dist.get_rank(), lifeline.end_node if headless else None)
        return sends

    def _on_emit(self, block: Block, value: Any) -> None:
        """``asyncpp.emit(value)`` in a block (the value already detached): send it to the driver
        now, numbered within its request. On a pipeline stage the value is first what this stage
        holds of it, as a result would be (the driver merges the stages' values)."""
        req = self._request_of(block)
        if req is None:  # pragma: no cover - every block here belongs to a request
            raise AsyncppError("asyncpp.emit(): this block belongs to no request on this worker")
        if self.stage is not None:
            value = self.stage.result(value)
        self.sender.value(req.aid, req.emitted, value)
        req.emitted += 1

    # --- the end of a request -------------------------------------------------------------------

    def _finish(self, rid: str) -> None:
        """Run the request's block to its end, drop all state of the request, and send the driver
        the request's end: its packed outcome, after all its streamed values."""
        req = self.requests[rid]
        packed = None
        try:
            packed = self._finish_block(rid)
        finally:
            if packed is None:  # (only an error of asyncpp's own gets here)
                packed = pack_outcome(None, RuntimeError("asyncpp could not finish this request's block"))
            self.sender.end(req.aid, req.emitted, packed)

    def _finish_block(self, rid: str) -> bytes:
        req = self.requests.pop(rid)
        self.stepping.pop(rid, None)
        self.eager_requests -= req.eager
        self.live -= req.live
        self.by_aid.pop(req.aid, None)
        block = req.block
        if block is None:
            err = req.error or RuntimeError("the request ended before its block could start")
            return pack_outcome(None, err)
        kernel = self.kernel
        stage = self.stage
        if stage is None:
            try:
                if not block.done:
                    kernel.finish_blocks([block])
            finally:
                kernel.forget(block)
                self.of_block.pop(id(block), None)
            return pack_outcome(block.result, block.error)
        result, error = None, None
        try:
            stage.serve([block])  # its parked pulls: every round of the request has run
            if not block.done:
                stage.outside = True  # code after its loops may await any value now
                try:
                    kernel.finish_blocks([block])
                finally:
                    stage.outside = False
            error = block.error
            if error is None:
                result = stage.result(block.result)
        except Exception as err:  # a pull that failed at the end: the request fails, not the worker
            error = err
        finally:
            stage.forget(block)
            kernel.forget(block)
            self.of_block.pop(id(block), None)
        # this stage is done with the request: its buffers go once every stage has said the same
        stage.service.release(req.num)
        return pack_outcome(result, error)

    def close(self) -> None:
        """vLLM shuts the worker down: end a pipeline stage's pull service first, while its peers
        are still there for the goodbyes (its listeners must not be left waiting in a receive when
        vLLM destroys the process groups: on the gloo wire that aborts the process)."""
        if self.stage is not None:
            service = self.stage.service
            service.close_grace_s = min(service.close_grace_s, CLOSE_GRACE_S)
            service.close()
            self.stage.close()

    def collect(self, ids: list[str]) -> None:
        """Finish these requests now. A request this worker does not hold (vLLM refused it, or it
        has just finished) still gets an end, so that the driver waits for nothing (the driver
        ignores a second end)."""
        for aid in ids:
            rid = self.by_aid.get(aid)
            if rid is None:
                gone = RuntimeError(f"no block of request {aid!r} on this worker")
                self.sender.end(aid, 0, pack_outcome(None, gone))
            else:
                self._finish(rid)

    def stats(self) -> dict[str, int]:
        return {
            "requests": len(self.requests),
            **self.kernel.stats(),
            "emitting": len(self.of_block),
            "eager_requests": self.eager_requests,
            "pid": os.getpid(),
            **self._stage_stats(),
        }

    def _stage_stats(self) -> dict[str, int]:
        if self.stage is None:
            return {}
        st = self.stage.service.stats
        cost = self.graft_cost
        graft = (
            {}
            if cost is None
            else {
                "graft_us": int(cost.seconds * 1e6),
                "graft_rss_bytes": cost.rss_bytes,
                "graft_tensor_bytes": cost.tensor_bytes,
                "graft_modules": cost.modules,
            }
        )
        return {
            **graft,
            "parked_pulls": len(self.stage.parked),
            "pulls": st.get("pulls", 0),
            "pull_bytes": st.get("bytes_in", 0),
            "pulled_value_bytes": st.get("value_bytes_in", 0),
            "pulls_waited": st.get("waited", 0),
            "pull_wait_us": st.get("wait_us", 0),
            "served_bytes": st.get("bytes_out", 0),
            **self.stage.service.held(),
        }


def _native_kernels(modules: Any) -> list[tuple[Any, Any, Any]]:
    """vLLM's custom ops (RMSNorm, SiluAndMul, rotary embedding, ...) among ``modules``, with what
    an eager step runs for each: on a compiled engine they run their plain-torch form, for inductor
    to fuse, and some of them compiled on their own (``torch.compile`` of that form, which only
    costs its guards when called from Python); an eager step runs their CPU form, as an eager
    engine does: (op, CPU form, compiled engine's form)."""
    from vllm.model_executor.custom_op import CustomOp

    out = []
    for m in modules:
        if isinstance(m, CustomOp):
            current = m.__dict__.get("_forward_method")
            if current is not None and getattr(current, "__func__", None) is not type(m).forward_cpu:
                out.append((m, m.forward_cpu, current))
    return out


def _compile_cache_counts() -> tuple[int, int]:
    """Inductor's compiled-graph cache hits and misses in this process so far."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])


def _quiet_warnings() -> None:
    """Unless the engine shows vLLM's logs (``ASYNCPP_VLLM_LOGS``, set by the driver while the
    engine starts), python warnings raised by vLLM's own modules in this worker are not shown
    (warnings from blocks, attributed to the user's modules, still are)."""
    if os.environ.get("ASYNCPP_VLLM_LOGS", "0") in ("", "0"):
        warnings.filterwarnings("ignore", module=r"vllm(\.|$)")


STACK_DUMP_ENV = (
    "ASYNCPP_STACK_DUMP"  # "1": SIGUSR1 dumps every thread's stack to stderr; a folder: to a file there
)
_dump_file: Any = None


def _stack_dumps() -> None:
    """With ASYNCPP_STACK_DUMP set, ``kill -USR1 <worker pid>`` dumps the stack of every thread of
    this worker (to stderr, or to ``<folder>/asyncpp-stacks-<pid>.txt``): what a hung pipeline is
    waiting on."""
    global _dump_file
    import faulthandler
    import signal

    where = os.environ.get(STACK_DUMP_ENV, "")
    if not where or where == "0":
        return
    if where == "1":
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        return
    os.makedirs(where, exist_ok=True)
    _dump_file = open(os.path.join(where, f"asyncpp-stacks-{os.getpid()}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_dump_file, all_threads=True)


class _Pipeline:
    __slots__ = ("ownership", "modules", "stage", "service", "local", "cost")


def _pipeline(runner: Any) -> _Pipeline | None:
    """On a pipeline-parallel engine: this stage's ownership of the full tree, its modules by
    index (None where another stage holds the module), and its cross-stage pull service.

    The full architecture is first grafted on the meta device under the stage's placeholders, so
    every stage reports the same tree as a one-stage model; if that copy cannot be built on some
    rank, every rank warns and uses the union of the stages' loaded trees instead."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    pp, tp = get_pp_group(), get_tp_group()
    if pp.world_size == 1:
        return None
    _allocate_stage_input(runner)
    model = runner.model
    out = _Pipeline()
    out.cost = None
    grafted = None
    try:
        grafted, out.cost = graft_full_model(model, runner.vllm_config)
        log.info("full tree grafted: %s", out.cost)
    except Exception as err:
        log.warning(
            "asyncpp could not graft a meta-device copy of the model under the pipeline stage's "
            "placeholders (%s: %s); using the union of the stages' module trees instead",
            type(err).__name__,
            err,
        )
    named = list(model.named_modules(remove_duplicate=True))
    named += list(runner.sampler.named_modules(prefix="sampler", remove_duplicate=True))
    mine = report(named, grafted)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (grafted is not None, mine))  # rank = stage * tp_size + tp_rank
    stages = [gathered[s * tp.world_size] for s in range(pp.world_size)]
    union = not all(ok for ok, _ in gathered)
    ownership = Ownership.from_reports(
        [rep for _, rep in stages], union=union, split=backend.split_paths(model)
    )
    local = {path: module for (path, module), (_, _, real) in zip(named, mine, strict=True) if real}
    out.ownership = ownership
    out.local = [(path, type_name) for path, type_name, _ in mine]
    out.modules = [local.get(p) for p in ownership.paths]
    out.stage = pp.rank_in_group
    column = None
    for t in range(tp.world_size):  # one pull group per TP column, created by every rank in order
        group = dist.new_group([s * tp.world_size + t for s in range(pp.world_size)], backend="gloo")
        if t == tp.rank_in_group:
            column = group
    out.service = PullService(column, pp.rank_in_group, pp.world_size, host=_pull_host(runner))
    out.service.start()
    return out


def _pull_host(runner: Any) -> str:
    """The address this worker's pull wire listens on: loopback on one node; across nodes, the one
    vLLM uses for this node (``VLLM_HOST_IP``, else the address vLLM finds)."""
    if int(runner.vllm_config.parallel_config.nnodes or 1) <= 1:
        return "127.0.0.1"
    from vllm.utils.network_utils import get_ip

    return os.environ.get("VLLM_HOST_IP") or get_ip()


def _allocate_stage_input(runner: Any) -> None:
    """vLLM (eager mode, CPU) allocates the receive buffer of stages after the first only in a
    dummy forward it never runs there: allocate it once, as that forward would."""
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")
