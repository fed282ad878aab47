"""The local engine: any ``torch.nn.Module`` (Hugging Face causal LMs included) run in-process.

A run is: batch the invokes' inputs, install the controllers, start every block (invoke order), run
the forward (or ``generate``), finish the interleaver, remove the controllers. Sync runs execute on
the calling thread; async runs on the engine's long-lived model thread. One run at a time per model.
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from typing import Any

import torch
from torch import nn

from ...kernel.batching import narrow
from ...kernel.errors import AsyncppError
from ...kernel.hooks import RunHooks
from ...kernel.interleaver import Interleaver
from ...locations import standard
from ...locations.tree import build_tree
from ...native import tls
from ...native.controllers import Controllers
from ..base import Deferred, Engine, InvokeOutcome, RunOutcome, RunSpec
from ..bridge import ModelThread, run_on_thread
from ..inputs import InputError, check_prompts, lm_batch, position_ids, tensor_batch, token_rows
from .views import PRESENTERS, head_of

_UNSET = object()


class _Labels:
    """The error-message names of the invokes with input, made only when an error needs one."""

    def __init__(self, invokes: list, given: list[int]):
        self._invokes, self._given = invokes, given

    def __getitem__(self, k: int) -> str:
        i = self._given[k]
        return f"invoke #{i} ({self._invokes[i].name})"

    def __iter__(self):
        return (self[k] for k in range(len(self._given)))


class _RowsOf(Deferred):
    """An invoke's rows of the model output, narrowed when first asked for (see Invoke.output)."""

    __slots__ = ("out", "rows", "batch")

    def __init__(self, out: Any, rows: tuple[int, int] | None, batch: int):
        self.out, self.rows, self.batch = out, rows, batch

    def resolve(self) -> Any:
        return narrow(self.out, self.rows, self.batch)


def _is_causal_lm(model: nn.Module) -> bool:
    return hasattr(model, "generate") and hasattr(model, "config")


class LocalEngine(Engine):
    """Runs intervention blocks on a local PyTorch model.

    :param model: any module; a Hugging Face causal LM also gets ``m.logits`` (its ``lm_head``
        output), string prompts (with ``tokenizer``), padding and ``generate``.
    :param tokenizer: turns string prompts into token ids (optional).
    :param standard_view: give blocks ``m.std``, the standard view (a causal LM of a family
        without one fails here, naming what its tree lacks; False runs it with the raw tree only).
    """

    supports_grad = True
    supports_streaming = True

    def __init__(
        self, model: nn.Module, tokenizer: Any = None, *, standard_view: bool = True, _cached: bool = False
    ):
        self._model = weakref.ref(model)
        self.tokenizer = tokenizer
        self.is_lm = _is_causal_lm(model)
        aliases = {}
        if self.is_lm and isinstance(getattr(model, "lm_head", None), nn.Module):
            # the logits the model returns (and generate samples from): after any transform of
            # lm_head's output, such as Gemma-2's final soft-capping; lm_head.output is the raw one
            aliases["logits"] = ("", "logits")
        self.tree, modules, self.paths = build_tree(model, aliases)
        if not self.is_lm:
            standard.attach(self.tree, None, f"{type(model).__name__} is not a causal language model")
        elif not standard_view:
            standard.attach(self.tree, None, "this engine was made with standard_view=False")
        else:
            try:
                standard.attach(self.tree, PRESENTERS, head=head_of(model))
            except standard.StandardViewError as err:
                if not _cached:
                    raise standard.StandardViewError(
                        f"{err}. LocalEngine(model, standard_view=False) runs it with the raw module "
                        f"tree only"
                    ) from None
                standard.attach(self.tree, None, str(err))  # (a trace given the model itself)
        self._controllers = Controllers(modules)  # builds the native extension on first use
        self._lock = _model_lock(model)  # one run at a time per model, whichever engine
        self._thread = ModelThread(f"asyncpp-model-{type(model).__name__}")
        weakref.finalize(self, self._thread.stop_soon).atexit = False
        self._switch: Any = _UNSET  # the thread-local-state swap, loaded at the first run
        self._tls_templates: dict[bool, Any] = {}  # see _tls_template
        # an engine the user made owns its model; the per-model cache of for_model() must not
        self._owned = None if _cached else model

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise ReferenceError("the model of this engine no longer exists")
        return model

    @classmethod
    def for_model(cls, model: nn.Module) -> LocalEngine:
        """The shared engine of ``model`` (created on first use)."""
        engine = _engines.get(model)
        if engine is None:
            engine = cls(model, _cached=True)
            _engines[model] = engine
        return engine

    # ----------------------------------------------------------------------------------------

    def run(self, spec: RunSpec) -> RunOutcome:
        return self._execute(spec)

    async def run_async(self, spec: RunSpec) -> RunOutcome:
        return await run_on_thread(self._thread, lambda: self._execute(spec))

    def submit(self, spec: RunSpec, post: Any, settle: Any) -> None:
        self._thread.submit(lambda: self._execute(spec), post, settle)

    def close(self) -> None:
        self._thread.stop()

    # ----------------------------------------------------------------------------------------

    @property
    def switch(self) -> Any:
        """The torch thread-local-state swap (None when switched off with ASYNCPP_NATIVE=0)."""
        if self._switch is _UNSET:
            self._switch = tls.get_switch()  # raises NativeBuildError when it cannot be built
        return self._switch

    def _tls_template(self, switch: Any, grad: bool) -> Any:
        """The torch state blocks of a run start from (forked per block), captured once per grad
        mode as the run sets it, so that forks are copies rather than fresh captures."""
        templates = self._tls_templates
        template = templates.get(grad)
        if template is None:
            with torch.set_grad_enabled(grad):
                template = templates[grad] = switch.BlockState()
        return template

    def _execute(self, spec: RunSpec) -> RunOutcome:
        call, rows, out_rows, batch_size, prompt_len, tokens = self._prepare(spec)
        switch = self.switch
        outcome = RunOutcome([InvokeOutcome() for _ in spec.invokes])
        kernel = Interleaver(
            self.paths,
            batch_size,
            step_index=0,
            switch=switch,
            hooks=RunHooks(on_emit=_emitter(outcome, spec.sink)),
            link=self._controllers.link,
            tls_template=None if switch is None else self._tls_template(switch, spec.grad),
            grad=spec.grad,
        )
        lock = self._lock
        if lock.owner == threading.get_ident():
            raise AsyncppError(
                f"a trace on {type(self.model).__name__} was started while a run on that same model "
                f"is in progress on this thread (from inside one of its blocks?); the run would wait "
                f"for itself forever. Start the second trace after the first one, or on another model"
            )
        with lock:
            self._controllers.install(kernel)  # (a gradient run keeps the native fast path off)
            try:
                with kernel.active(), torch.set_grad_enabled(spec.grad):
                    for order, inv in enumerate(spec.invokes):
                        kernel.start(
                            inv.block(self.tree, *inv.args, **inv.kwargs),
                            order,
                            rows[order],
                            inv.name,
                            tokens=tokens[order],
                        )
                    kernel.serve()
                    try:
                        out = call()
                    except BaseException as err:
                        outcome.error = err
                        out = None
                    if outcome.error is None:
                        kernel.finish()
                    else:
                        kernel.close_all()
            finally:
                self._controllers.remove()
        outcome.output = out
        for order, block in enumerate(kernel.blocks):
            o = outcome.invokes[order]
            o.result, o.error = block.result, block.error
            if out is not None:
                r = out_rows[order]
                if spec.generate:
                    seq = out if r is None else out[r[0] : r[1]]
                    o.tokens = seq[:, prompt_len:].clone()
                else:
                    o.output = _RowsOf(out, r, batch_size)
        return outcome

    def _prepare(self, spec: RunSpec):
        """Build the batched call and each invoke's rows (of the batch its blocks see, and of the
        model's output); a generation that expands each prompt (beams, several sequences) widens
        both."""
        invokes = spec.invokes
        given = [i for i, inv in enumerate(invokes) if inv.input is not None]
        if not given:
            raise InputError("the trace has no input: give at least one invoke an input")
        where = _Labels(invokes, given)  # "invoke #i (block)" for error messages, built on demand
        model = self.model
        prompt_len = 0
        expand = out_factor = 1
        tokens: list[int | None] = [None] * len(invokes)  # each invoke's longest prompt
        if self.is_lm:
            vocab, positions = _limits(model)
            per = [token_rows(invokes[i].input, self.tokenizer, w) for i, w in zip(given, where)]
            new_tokens = (spec.max_new_tokens or 1) if spec.generate else 0
            for p, w in zip(per, where):
                check_prompts(p, w, vocab, positions, new_tokens)
            sizes = [len(p) for p in per]
            for i, p in zip(given, per):
                tokens[i] = max(len(r) for r in p)
            pad = getattr(model.config, "pad_token_id", None)
            if pad is None:
                pad = getattr(model.config, "eos_token_id", None) or 0
                if isinstance(pad, list):
                    pad = pad[0]
            inputs = lm_batch([r for p in per for r in p], pad)
            prompt_len = inputs["input_ids"].shape[1]
            if spec.generate:
                gen = {"max_new_tokens": spec.max_new_tokens or 1, "do_sample": False, "pad_token_id": pad}
                gen.update(spec.model_kwargs)
                expand, out_factor = _expansion(model, gen)
                rows_in = sum(sizes)
                hook = model.register_forward_pre_hook(
                    _batch_check(self._controllers.link, rows_in * expand, rows_in, expand), with_kwargs=True
                )

                def call():
                    try:
                        return model.generate(**inputs, **gen)
                    finally:
                        hook.remove()
            else:
                kwargs = {**inputs, **spec.model_kwargs}
                padded = not bool(inputs["attention_mask"].all())
                if padded and "position_ids" not in kwargs and _takes(model, "position_ids"):
                    # learned absolute positions (GPT-2) must count from each row's first real token
                    kwargs["position_ids"] = position_ids(inputs["attention_mask"])

                def call():
                    return model(**kwargs)
        else:
            if spec.generate:
                raise InputError(f"{type(model).__name__} has no generate(): use asyncpp.trace, not generate")
            args, sizes = tensor_batch([invokes[i].input for i in given], where)
            mk = spec.model_kwargs

            def call():
                return model(*args, **mk)

        batch_size = sum(sizes) * expand
        if len(given) == 1 and len(invokes) == 1:
            return call, [None], [None], batch_size, prompt_len, tokens
        rows: list[tuple[int, int] | None] = [None] * len(invokes)
        out_rows: list[tuple[int, int] | None] = [None] * len(invokes)
        start = 0
        for i, n in zip(given, sizes):
            rows[i] = (start * expand, (start + n) * expand)
            out_rows[i] = (start * out_factor, (start + n) * out_factor)
            start += n
        return call, rows, out_rows, batch_size, prompt_len, tokens


def _emitter(outcome: RunOutcome, sink: Any):
    """The interleaver's on_emit: keep a block's streamed values with its outcome, and pass each
    to the run's sink (the caller's live stream), if any."""
    invokes = outcome.invokes

    def on_emit(block: Any, value: Any) -> None:
        invokes[block.order].emitted.append(value)
        if sink is not None:
            sink(block.order, value)

    return on_emit


def _takes(model: nn.Module, name: str) -> bool:
    """Whether the model's forward has a parameter ``name`` (its class's, whatever is installed)."""
    try:
        return name in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


def _limits(model: nn.Module) -> tuple[int | None, int | None]:
    """The model's vocabulary size (rows of its input embedding) and number of positions."""
    vocab = None
    try:
        emb = model.get_input_embeddings()
        vocab = int(emb.num_embeddings) if isinstance(emb, nn.Embedding) else None
    except (AttributeError, NotImplementedError):
        pass
    if vocab is None:
        vocab = getattr(model.config, "vocab_size", None)
    positions = getattr(model.config, "max_position_embeddings", None)
    return vocab, positions if isinstance(positions, int) and positions > 0 else None


def _expansion(model: nn.Module, gen: dict) -> tuple[int, int]:
    """How many rows ``generate`` runs per prompt (beams, or sequences sampled per prompt) and how
    many sequences it returns per prompt, from the model's generation config and ``gen``."""
    base = gen.get("generation_config") or getattr(model, "generation_config", None)
    if base is None:
        return 1, 1
    config = copy.deepcopy(base)
    config.update(**{k: v for k, v in gen.items() if k != "generation_config"})
    beams = int(getattr(config, "num_beams", 1) or 1)
    sequences = int(getattr(config, "num_return_sequences", 1) or 1)
    return max(beams, sequences), sequences


def _batch_check(link: Any, expected: int, prompts: int, expand: int):
    """A pre-hook on the root that refuses a generation step whose batch is not the one the
    invokes' rows were laid out for (a generation mode that reshapes the batch another way)."""

    def check(module: nn.Module, args: tuple, kwargs: dict):
        if link.bypass:  # a block calling the model itself
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() and ids.shape[0] != expected:
            raise AsyncppError(
                f"generate ran a batch of {ids.shape[0]} rows, but asyncpp laid out {expected} "
                f"({prompts} prompts x {expand} rows each) for the invokes' blocks: this generation "
                f"mode changes the batch in a way asyncpp does not support"
            )
        return None

    return check


_engines: weakref.WeakKeyDictionary[nn.Module, LocalEngine] = weakref.WeakKeyDictionary()


class _ModelLock:
    """Serializes runs on one model, and knows which thread runs it (to refuse re-entry)."""

    __slots__ = ("_lock", "owner")

    def __init__(self):
        self._lock = threading.Lock()
        self.owner: int | None = None

    def __enter__(self) -> None:
        self._lock.acquire()
        self.owner = threading.get_ident()

    def __exit__(self, *exc: Any) -> None:
        self.owner = None
        self._lock.release()


_locks: weakref.WeakKeyDictionary[nn.Module, _ModelLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _model_lock(model: nn.Module) -> _ModelLock:
    """The lock that serializes runs on ``model`` across every engine built on it."""
    with _locks_guard:
        lock = _locks.get(model)
        if lock is None:
            lock = _locks[model] = _ModelLock()
        return lock
