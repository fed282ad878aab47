"""The vLLM engine: asyncpp blocks on a real vLLM engine (``AsyncLLM``), one request per invoke.

The engine owns an ``AsyncLLM`` on a private event loop in a background thread, so it serves sync
scripts and async applications (asyncio, uvloop, trio) alike, and many traces at once: each invoke
becomes a vLLM request carrying its block, and vLLM batches all of them continuously. When a
request's last output arrives, its block's outcome is collected from the workers.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import itertools
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from ...kernel.errors import AsyncppError
from ...locations.tree import tree_from_paths
from ...pp.merge import NOT_HERE, merge
from ...trace.bridge import await_future
from ..base import Engine, InvokeOutcome, RunOutcome, RunSpec
from ..local.inputs import InputError, token_rows
from .transport import pack_block, unpack_outcome
from .worker import ALIASES, EXTRA_KEY, ID_KEY, NUM_KEY

WORKER = "asyncpp.engines.vllm.worker.AsyncppWorker"


class VllmEngine(Engine):
    """Runs intervention blocks on a vLLM engine.

    :param model: a model folder (``save_pretrained`` layout) or name; default: the embedded tiny
        model.
    :param max_model_len: the longest prompt plus generation; every prompt is scheduled whole.
    :param kv_cache_gib: KV-cache size per worker (``kv_cache_memory_bytes``).
    :param vllm_options: passed to ``AsyncEngineArgs`` (``tensor_parallel_size``, ``dtype``, ...);
        asyncpp's defaults keep hooks correct: eager mode, prefix caching and chunked prefill off.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        max_model_len: int = 512,
        kv_cache_gib: float = 1,
        **vllm_options: Any,
    ):
        if model is None:
            from ...models import tiny_model_dir

            model = tiny_model_dir()
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # set it to INFO to see vLLM's logs
        options = {
            "model": str(model),
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "enable_chunked_prefill": False,
            "long_prefill_token_threshold": 0,  # > 0 splits prompts even with chunking off
            "max_model_len": max_model_len,
            "max_num_batched_tokens": max(
                max_model_len, int(vllm_options.pop("max_num_batched_tokens", 0) or 0)
            ),
            "worker_cls": WORKER,
            "kv_cache_memory_bytes": int(kv_cache_gib * 2**30),
        }
        options.update(vllm_options)
        if options["worker_cls"] != WORKER:
            raise ValueError("VllmEngine needs asyncpp's worker class; leave worker_cls unset")
        self.options = options
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncpp-vllm", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        try:
            self._llm, entries = self._call(self._start())
        except BaseException:
            self._stop_loop()
            raise
        self.tree = tree_from_paths([(p, t) for p, t in entries], ALIASES)
        self.tokenizer = _load_tokenizer(options["model"])
        atexit.register(self.close)  # vLLM's own teardown at interpreter exit is noisy

    # --- the engine's own loop ------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self) -> tuple[Any, list]:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.options))
        try:
            entries = (await llm.collective_rpc("asyncpp_tree"))[0]
        except BaseException:
            llm.shutdown()
            raise
        return llm, entries

    # --- Engine ---------------------------------------------------------------------------------

    def run(self, spec: RunSpec) -> RunOutcome:
        self._check_open()
        return self._call(self._run(spec))

    async def run_async(self, spec: RunSpec) -> RunOutcome:
        self._check_open()
        return await await_future(asyncio.run_coroutine_threadsafe(self._run(spec), self._loop))

    def close(self) -> None:
        """Shut vLLM down (its processes exit) and stop the engine's thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)

        async def shutdown(llm: Any) -> None:
            llm.shutdown(timeout=60)  # let vLLM's processes stop by themselves (no forced kill)

        try:
            self._call(shutdown(self._llm))
        finally:
            self._llm = None  # AsyncLLM's own __del__ at interpreter exit is noisy: collect it now
            gc.collect()
            self._stop_loop()

    def worker_stats(self) -> list[dict[str, int]]:
        """Per-request state each worker holds now (requests, blocks, waits...), for leak checks."""
        self._check_open()

        async def stats() -> Any:
            return await self._llm.collective_rpc("asyncpp_stats")

        return self._call(stats())

    def worker_trees(self) -> list[list[tuple[str, str]]]:
        """Every worker's own module tree as (path, type name) in ``named_modules()`` order, in rank
        order (on a pipeline-parallel engine, with the full architecture grafted under each stage's
        placeholders, every rank's equals the one-stage model's)."""
        self._check_open()

        async def trees() -> Any:
            return await self._llm.collective_rpc("asyncpp_tree", args=(True,))

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

    # --- one trace ------------------------------------------------------------------------------

    async def _run(self, spec: RunSpec) -> RunOutcome:
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

        invokes = spec.invokes
        prompts = []
        for i, inv in enumerate(invokes):
            where = f"invoke #{i} ({inv.name})"
            if inv.input is None:
                raise InputError(f"{where}: on vLLM every invoke is a request and needs a prompt")
            rows = token_rows(inv.input, self.tokenizer, where)
            if len(rows) != 1:
                raise InputError(f"{where}: one prompt per invoke on vLLM (got {len(rows)} rows)")
            prompts.append(rows[0])
        nums = [next(self._ids) for _ in invokes]
        ids = [f"asyncpp-{n}-{uuid.uuid4().hex[:8]}" for n in nums]
        options = {"temperature": 0.0, **spec.model_kwargs}
        max_tokens = spec.max_new_tokens if spec.generate else 1
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                **options,
                extra_args={
                    EXTRA_KEY: pack_block(inv.block, inv.args, inv.kwargs),
                    ID_KEY: rid,
                    NUM_KEY: num,
                },
            )
            for inv, rid, num in zip(invokes, ids, nums)
        ]
        llm = self._llm

        async def one(prompt: list[int], sp: Any, rid: str) -> Any:
            final = None
            async for out in llm.generate(tokens_input(prompt), sp, request_id=rid):
                final = out
            return final

        try:
            finals = await asyncio.gather(
                *(one(p, sp, r) for p, sp, r in zip(prompts, params, ids)), return_exceptions=True
            )
        finally:
            # always collect, also when the caller gave up: the workers then drop every trace
            collect = asyncio.ensure_future(llm.collective_rpc("asyncpp_collect", args=(ids,)))
            per_rank = await asyncio.shield(collect)
        outcome = RunOutcome([])
        for i, final in enumerate(finals):
            o = InvokeOutcome()
            o.result, o.error = self._outcome([ranks[i] for ranks in per_rank])
            if isinstance(final, BaseException):
                o.error = final  # vLLM refused or lost the request: its own error says why
            elif final is not None:
                o.output = final
                o.tokens = torch.tensor([list(final.outputs[0].token_ids)], dtype=torch.long)
            outcome.invokes.append(o)
        outcome.output = [o.output for o in outcome.invokes]
        return outcome

    def _outcome(self, packed: list[bytes]) -> tuple[Any, BaseException | None]:
        """One request's outcome from every rank's: rank 0's, or on a pipeline-parallel engine the
        stages' results merged (TP rank 0 of each stage); the first stage's error wins."""
        pp = int(self.options.get("pipeline_parallel_size", 1) or 1)
        if pp == 1:
            return unpack_outcome(packed[0])
        tp = int(self.options.get("tensor_parallel_size", 1) or 1)
        stages = [unpack_outcome(packed[s * tp]) for s in range(pp)]
        for _result, error in stages:
            if error is not None:
                return None, error
        merged = merge([r for r, _ in stages])
        return (None if merged is NOT_HERE else merged), None


def _load_tokenizer(model: str) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    except Exception:
        return None
