"""asyncpp's vLLM worker: runs every request's block inside the worker's model execution.

vLLM builds this class by its dotted name in each worker process (``worker_cls``). After the model
is loaded, the controllers are installed on every module of the model and on the runner's sampler,
for good, and one long-lived interleaver serves all requests:

* a request's block is **started** at the first forward that includes the request (its rows known,
  the forward's torch state, inference mode, as its initial state);
* it is **stepped** by the controllers during each forward, seeing its own token rows of model
  modules and its own row of ``logits`` and ``samples``; each forward its request takes part in is
  one generation step of its own;
* it is **finished** when the driver collects its result after the request's last output (or when
  the request is reported finished), and every trace of it is dropped.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from ... import tls
from ...kernel.interleaver import Block, Interleaver
from ...locations.tree import build_tree
from ..local.controllers import Controllers
from .tensor_parallel import find_shardings
from .transport import pack_outcome, unpack_block

log = logging.getLogger("asyncpp.vllm")

EXTRA_KEY = "asyncpp"  # SamplingParams.extra_args: the packed block
ID_KEY = "asyncpp_id"  # SamplingParams.extra_args: the caller's id for the request
ALIASES = {"logits": "logits_processor", "samples": "sampler"}


class AsyncppWorker(CPUWorker):
    """vLLM's CPU worker with asyncpp's controllers and interleaver."""

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        out = super().load_model(*args, **kwargs)
        self.asyncpp = WorkerSession(self.model_runner)
        return out

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self.asyncpp.before_step(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)

    # --- called by the driver through collective_rpc (between engine steps) ---------------------

    def asyncpp_tree(self) -> list[list[str]]:
        """The model's module tree as [path, type name] pairs, in index order."""
        return self.asyncpp.tree_entries()

    def asyncpp_collect(self, ids: list[str]) -> list[bytes]:
        """Finish these requests' blocks and return their packed outcomes (and forget them)."""
        return self.asyncpp.collect(ids)

    def asyncpp_stats(self) -> dict[str, int]:
        """How much per-request state this worker holds (for leak checks)."""
        return self.asyncpp.stats()


class _Request:
    __slots__ = ("aid", "payload", "block", "outcome", "error")

    def __init__(self, aid: str, payload: bytes):
        self.aid = aid
        self.payload = payload
        self.block: Block | None = None
        self.outcome: bytes | None = None  # packed, once the block is finished
        self.error: BaseException | None = None  # a failure before the block could start


class WorkerSession:
    """The per-worker state: controllers, the interleaver, and the requests that carry blocks."""

    def __init__(self, runner: Any):
        self.runner = runner
        model = runner.model
        self.tree, modules, self.paths = build_tree(model, ALIASES, {"sampler": runner.sampler})
        self.controllers = Controllers(modules)
        kernel = Interleaver(self.paths, 0, step_index=0, switch=tls.get_switch(), slot=self.controllers.slot)
        kernel.on_step = self._on_step
        kernel.request_level = frozenset(
            i for i, p in enumerate(self.paths) if _under(p, "logits_processor") or _under(p, "sampler")
        )
        kernel.shard_out, kernel.shard_in = find_shardings(modules, self.paths)
        # the sampler edits the logits in place (temperature): blocks keep what they were served
        kernel.copy_after = frozenset(i for i, p in enumerate(self.paths) if p == "logits_processor")
        self.kernel = kernel
        self.requests: dict[str, _Request] = {}  # vLLM request id -> request with a block
        self.by_aid: dict[str, str] = {}  # caller id -> vLLM request id
        self.done: dict[str, bytes] = {}  # caller id -> outcome of a request vLLM reported finished
        self.scheduled: dict[str, int] = {}
        self._order = 0
        self.controllers.install(kernel)  # for good: this process runs nothing else

    def tree_entries(self) -> list[list[str]]:
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
            self.requests[new.req_id] = _Request(aid, payload)
            self.by_aid[aid] = new.req_id
            prompt = len(new.prompt_token_ids or ())
            scheduled = so.num_scheduled_tokens.get(new.req_id, 0)
            if new.num_computed_tokens + scheduled < prompt:
                self.requests[new.req_id].error = RuntimeError(
                    f"vLLM scheduled only {scheduled} of the prompt's {prompt} tokens in one step; "
                    f"asyncpp presents a prompt to a block whole, so this request's block was not run. "
                    f"Keep chunked prefill off, long_prefill_token_threshold at 0 and "
                    f"max_num_batched_tokens at least as long as the longest prompt"
                )
        for rid in so.finished_req_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.done[req.aid] = self._finish(rid)

    def _on_step(self, step: int) -> list[Block]:
        """At the start of each forward: every request's rows, and its block started if new."""
        runner = self.runner
        batch = runner.input_batch
        starts = runner.query_start_loc.np
        n = batch.num_reqs
        kernel = self.kernel
        kernel.batch_size = int(starts[n])
        kernel.req_batch = n
        active = []
        for i, rid in enumerate(batch.req_ids[:n]):
            req = self.requests.get(rid)
            if req is None or req.error is not None:
                continue
            rows = (int(starts[i]), int(starts[i + 1]))
            block = req.block
            if block is None:
                block = self._start(req, rows, (i, i + 1))
                if block is None:
                    continue
            else:
                block.rows, block.req_rows = rows, (i, i + 1)
            active.append(block)
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
        block = self.kernel.start(
            coro, self._order, rows, name=getattr(fn, "__qualname__", "block"), req_rows=req_rows
        )
        req.block = block
        return block

    def _finish(self, rid: str) -> bytes:
        """Run the request's block to its end, pack its outcome, drop all state of the request."""
        req = self.requests.pop(rid)
        self.by_aid.pop(req.aid, None)
        block = req.block
        if block is None:
            err = req.error or RuntimeError("the request ended before its block could start")
            return pack_outcome(None, err)
        kernel = self.kernel
        if not block.done:
            kernel.finish_blocks([block])
        kernel.forget(block)
        return pack_outcome(block.result, block.error)

    def collect(self, ids: list[str]) -> list[bytes]:
        out = []
        for aid in ids:
            packed = self.done.pop(aid, None)
            if packed is None:
                rid = self.by_aid.get(aid)
                if rid is None:
                    packed = pack_outcome(None, RuntimeError(f"no block of request {aid!r} on this worker"))
                else:
                    packed = self._finish(rid)
            out.append(packed)
        return out

    def stats(self) -> dict[str, int]:
        k = self.kernel
        return {
            "requests": len(self.requests),
            "done": len(self.done),
            "blocks": len(k.blocks),
            "waits": sum(len(v) for v in k.waits.values()),
            "gates": len(k._gates),
            "hot_in": len(k.hot_in),
            "hot_out": len(k.hot_out),
        }


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")
