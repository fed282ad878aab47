"""A headless node of a multi-node engine: the workers of nodes 1 to ``nnodes - 1``.

A ``VllmEngine`` made with ``nnodes=N`` is the head node (node 0): it runs vLLM's engine core and
its own share of the workers. Every other node runs :func:`run_node` (or ``asyncpp serve
--headless``) with the same model and options and its own ``node_rank``: vLLM's multiprocessing
executor, headless, starts that node's workers, which join the head's at ``master_addr``:
``master_port`` and then take their steps from the head. The node runs until the head's engine
closes or is gone (see ``links.py``), or until it is stopped (SIGTERM, Ctrl-C).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import console
from .options import engine_options, local_workers


def run_node(
    model: str | Path | None = None,
    *,
    node_rank: int,
    nnodes: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29501,
    max_model_len: int = 512,
    kv_cache_gib: float = 1,
    vllm_logs: bool | None = None,
    mode: str | None = None,
    taps: Sequence[str] = (),
    node_timeout: float = 300,
    **vllm_options: Any,
) -> None:
    """Run the workers of node ``node_rank`` (1 to ``nnodes - 1``) of a multi-node engine whose
    head is a ``VllmEngine(model, nnodes=nnodes, node_rank=0, master_addr=..., master_port=...)``
    made with the same model and options (``mode``, ``taps``, ``tensor_parallel_size``,
    ``pipeline_parallel_size``, ``dtype``, ...). Returns when the node's workers have ended: the
    head's engine closed or is gone, or the node was stopped (SIGTERM or Ctrl-C). A node whose
    workers have not joined the head's within ``node_timeout`` seconds stops, and raises
    ``TimeoutError``."""
    console.refuse_in_spawned_child("asyncpp.engines.vllm.run_node(...)")
    if nnodes < 2 or node_rank == 0:
        raise ValueError(
            f"run_node is for nodes 1 to nnodes - 1 of a multi-node engine (got node_rank={node_rank}, "
            f"nnodes={nnodes}); node 0 is the head: asyncpp.VllmEngine(..., nnodes={nnodes}, node_rank=0)"
        )
    logs = console.want_logs(vllm_logs)
    built = engine_options(
        model,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib,
        vllm_logs=logs,
        mode=mode,
        taps=taps,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        **vllm_options,
    )
    options = built.options
    quiet = None if logs else console.StderrFilter()
    executor = None
    with _stop_signals():
        try:
            with (
                console.starting_env(logs, local_workers(options)),
                quiet.redirect() if quiet else contextlib.nullcontext(),
            ):
                from vllm.engine.arg_utils import AsyncEngineArgs
                from vllm.usage.usage_lib import UsageContext
                from vllm.v1.executor.multiproc_executor import MultiprocExecutor

                config = AsyncEngineArgs(**options).create_engine_config(
                    UsageContext.OPENAI_API_SERVER, headless=True
                )
                _say(
                    f"node {node_rank} of {nnodes}: starting {local_workers(options)} worker(s) of the "
                    f"{console.describe(options, built.default_model, built.mode)}, head at "
                    f"{master_addr}:{master_port}"
                )
                joining = threading.Timer(node_timeout, _give_up)
                joining.daemon = True
                joining.start()
                try:
                    executor = MultiprocExecutor(config, monitor_workers=False)
                finally:
                    joining.cancel()
            _say(f"node {node_rank} of {nnodes}: joined; its workers serve the head node's engine")
            executor.start_worker_monitor(inline=True)  # returns when a worker has ended
        except SystemExit:
            if executor is None and _gave_up.is_set():
                raise TimeoutError(
                    f"node {node_rank} of {nnodes}: its workers did not join the head node's at "
                    f"{master_addr}:{master_port} within node_timeout={node_timeout:g} s. Is the head "
                    f"(asyncpp.VllmEngine(..., nnodes={nnodes}, node_rank=0)) running there, with the "
                    f"same model and options?"
                ) from None
        finally:
            if executor is not None:
                executor.shutdown()
    _say(f"node {node_rank} of {nnodes}: stopped")


_gave_up = threading.Event()


def _give_up() -> None:
    """The join deadline passed: stop the node's start as SIGTERM would (its workers end)."""
    _gave_up.set()
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM and SIGINT stop the node (SystemExit, once), as vLLM's own headless nodes."""
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise SystemExit(128 + signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _say(text: str) -> None:
    print(f"asyncpp: {text}", file=sys.stderr, flush=True)
