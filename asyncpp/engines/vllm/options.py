"""The vLLM options an asyncpp engine runs with, built in one place for the head node
(:class:`~asyncpp.engines.vllm.VllmEngine`) and for the headless nodes of a multi-node engine
(:func:`~asyncpp.engines.vllm.run_node`): every node builds its own vLLM config, and the nodes'
workers only agree when those configs are the same.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .keys import EXTRA_KEY
from .taps import TAPS_VERSION, check_patterns

WORKER = "asyncpp.engines.vllm.worker.AsyncppWorker"
MODES = ("auto", "compiled", "eager")


@dataclass
class EngineOptions:
    """What :func:`engine_options` builds."""

    options: dict[str, Any]  # for vLLM's AsyncEngineArgs
    mode: str  # "auto", "compiled" or "eager"
    patterns: list[str]  # the user's extra tap patterns
    default_model: bool  # the embedded tiny model (no model was given)


def engine_options(
    model: str | Path | None = None,
    *,
    max_model_len: int = 512,
    kv_cache_gib: float = 1,
    vllm_logs: bool = False,
    mode: str | None = None,
    taps: Sequence[str] = (),
    **vllm_options: Any,
) -> EngineOptions:
    """vLLM's engine arguments for an asyncpp engine (see ``VllmEngine`` for the parameters):
    asyncpp's worker, prefix caching and chunked prefill off, the tap patterns for the workers."""
    default_model = model is None
    if model is None:
        from ...models import tiny_model_dir

        model = tiny_model_dir()
        # a float32 checkpoint: vLLM's "auto" would run it in bfloat16, whose CPU kernels need
        # instructions not every machine has (a worker died of SIGILL on one here)
        vllm_options.setdefault("dtype", "float32")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_mode = _mode(mode, vllm_options.pop("enforce_eager", None))
    patterns = check_patterns(taps)
    if patterns and run_mode == "eager":
        raise ValueError(
            "taps=... is for compiled engines (mode='compiled' or 'auto'): eager engines serve every location"
        )
    options: dict[str, Any] = {
        "model": str(model),
        "enforce_eager": run_mode == "eager",
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "long_prefill_token_threshold": 0,  # > 0 splits prompts even with chunking off
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max(max_model_len, int(vllm_options.pop("max_num_batched_tokens", 0) or 0)),
        "worker_cls": WORKER,
        "kv_cache_memory_bytes": int(kv_cache_gib * 2**30),
    }
    if not vllm_logs:
        options["use_tqdm_on_load"] = False  # the weight-loading progress bar
    options.update(vllm_options)
    if run_mode != "eager":
        options["compilation_config"] = _functionalization_v2(options.get("compilation_config"))
    extra = dict(options.get("additional_config") or {})
    # the tap patterns; each worker resolves them and keys vLLM's compile cache by the result
    extra[EXTRA_KEY] = {"taps": patterns, "taps_version": TAPS_VERSION, "auto": run_mode == "auto"}
    options["additional_config"] = extra
    if options["worker_cls"] != WORKER:
        raise ValueError("VllmEngine needs asyncpp's worker class; leave worker_cls unset")
    if int(options.get("data_parallel_size") or 1) != 1:
        raise ValueError(
            f"VllmEngine runs one data-parallel rank, not data_parallel_size="
            f"{options['data_parallel_size']}: vLLM would split the requests over engines that "
            f"asyncpp's engine-wide calls (taps, worker_stats, ...) do not all reach. For more "
            f"throughput create several engines, or use tensor or pipeline parallelism"
        )
    if options.get("speculative_config") is not None:
        raise ValueError(
            "VllmEngine does not run speculative decoding (speculative_config): a step would hold "
            "several proposed tokens of a request, some of them then rejected, so a block's steps "
            "would not be its tokens; leave speculative_config unset"
        )
    if nodes(options) > 1:
        _multinode(options)
    return EngineOptions(options, run_mode, patterns, default_model)


FUNCTIONALIZATION_V2 = "enable_auto_functionalized_v2"


def _functionalization_v2(config: Any) -> Any:
    """vLLM's compilation config with inductor's auto-functionalization v2 (unless the user chose).

    vLLM picks v1 for its own fusion passes. A tap mutates the graph's tensors, and under v1 two
    taps that mutate views of one tensor (a layer's ``rotary_emb.inputs``, views of its q-k-v
    projection, then its ``attn.inputs``) were copied back wrongly: the model computed NaNs."""
    if config is None:
        config = {}
    if isinstance(config, str):
        config = json.loads(config)
    if isinstance(config, dict):
        config = dict(config)
        inductor = dict(config.get("inductor_compile_config") or {})
        inductor.setdefault(FUNCTIONALIZATION_V2, True)
        config["inductor_compile_config"] = inductor
        return config
    inductor = getattr(config, "inductor_compile_config", None)
    if isinstance(inductor, dict):
        inductor.setdefault(FUNCTIONALIZATION_V2, True)
    return config


def _multinode(options: dict[str, Any]) -> None:
    """The settings of an engine spanning ``nnodes`` nodes (vLLM's multiprocessing executor)."""
    n = nodes(options)
    rank = int(options.get("node_rank", 0) or 0)
    if not 0 <= rank < n:
        raise ValueError(f"node_rank={rank} is not a node of nnodes={n} (0 to {n - 1})")
    backend = options.setdefault("distributed_executor_backend", "mp")
    if backend != "mp":
        raise ValueError(
            f"distributed_executor_backend={backend!r}: asyncpp runs multi-node engines on vLLM's "
            f"multiprocessing executor ('mp'); vLLM's CPU platform does not run Ray (docs/scale-out.md)"
        )
    workers = size(options, "tensor_parallel_size") * size(options, "pipeline_parallel_size")
    if workers % n:
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {workers} workers cannot be split evenly "
            f"over nnodes={n} nodes"
        )
    per_node = workers // n
    if per_node > 1 and "device_ids" not in options and _on_cpu():
        # vLLM tells which workers share a node from the platform's device count, 1 on CPU: with
        # more workers per node, the head's executor found no queue to its second worker. The
        # devices a node's workers use, named, give it the count.
        options["device_ids"] = list(range(per_node))
    addr = str(options.setdefault("master_addr", "127.0.0.1"))
    if is_loopback(addr) and "VLLM_HOST_IP" not in os.environ:
        # every node is on this host: vLLM's queues between nodes connect to this address, not to
        # the one vLLM would guess (which need not be reachable: on one machine here a start
        # waited 100 s for it)
        os.environ["VLLM_HOST_IP"] = "127.0.0.1" if ":" not in addr else "::1"


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _mode(mode: str | None, enforce_eager: Any) -> str:
    """The engine's mode, from ``mode`` or vLLM's own ``enforce_eager`` (not both)."""
    if mode is not None and enforce_eager is not None:
        raise ValueError("pass mode='auto', 'compiled' or 'eager', not enforce_eager as well")
    if mode is None:
        return "eager" if enforce_eager else "auto"
    if mode not in MODES:
        raise ValueError(f"mode must be 'auto', 'compiled' or 'eager', not {mode!r}")
    return mode


def size(options: dict[str, Any], key: str) -> int:
    """``tensor_parallel_size`` or ``pipeline_parallel_size`` of these engine options."""
    return int(options.get(key, 1) or 1)


def nodes(options: dict[str, Any]) -> int:
    """How many nodes the engine spans (``nnodes``)."""
    return int(options.get("nnodes", 1) or 1)


def local_workers(options: dict[str, Any]) -> int:
    """How many of the engine's workers run on each node."""
    return size(options, "tensor_parallel_size") * size(options, "pipeline_parallel_size") // nodes(options)
