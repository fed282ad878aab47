"""The engine contract: what a trace needs from the thing that runs the model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..locations.tree import Root


@dataclass(slots=True)
class InvokeSpec:
    """One invoke: its input (None for the whole batch), its block and the block's arguments."""

    input: Any
    block: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    name: str = "block"


@dataclass
class RunSpec:
    """Everything one run needs: the invokes, and how to drive the model."""

    invokes: list[InvokeSpec]
    generate: bool = False
    max_new_tokens: int | None = None
    grad: bool = False
    model_kwargs: dict = field(default_factory=dict)
    # values blocks emit (asyncpp.emit): sink(invoke index, value), called on the model's thread
    sink: Callable[[int, Any], None] | None = None
    # engines that stream tokens (streams_tokens): token_sink(invoke index, new token ids) as each
    # step's tokens are sampled, on the engine's thread
    token_sink: Callable[[int, list[int]], None] | None = None


async def no_block(m: Any) -> None:
    """The block of an invoke given none (``t.invoke(prompt)``): its request just runs."""
    return None


no_block.__qualname__ = "(no block)"


class Deferred:
    """A value an engine computes only if the user asks for it (an invoke's rows of the output)."""

    __slots__ = ()

    def resolve(self) -> Any:
        raise NotImplementedError


@dataclass(slots=True)
class InvokeOutcome:
    """What one invoke produced: its block's result or error, and its rows of the model output."""

    result: Any = None
    error: BaseException | None = None
    output: Any = None
    tokens: Any = None
    emitted: list = field(default_factory=list)  # what its block streamed, in order


@dataclass
class RunOutcome:
    invokes: list[InvokeOutcome]
    output: Any = None
    error: BaseException | None = None  # the model's own failure (not a block's)


class Engine(ABC):
    """Runs a model with intervention blocks attached. Subclasses: local torch models, vLLM."""

    tree: Root
    supports_grad: bool = False  # whether traces with grad=True (and backward passes) run on it
    supports_streaming: bool = False  # whether blocks may asyncpp.emit() (see submit)
    streams_tokens: bool = False  # whether a streamed run reports tokens as they are sampled

    @abstractmethod
    def run(self, spec: RunSpec) -> RunOutcome:
        """Run synchronously (blocks the calling thread until the run is done)."""

    @abstractmethod
    async def run_async(self, spec: RunSpec) -> RunOutcome:
        """Run off the caller's event loop and await the outcome."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine's threads and processes."""

    def check_options(self, spec: RunSpec) -> None:
        """Refuse run options (a trace's keyword arguments) this engine cannot take, when the
        trace is made: the error then points at the user's ``trace(...)`` line, not at the run.
        The local engine passes them to the model's call, which checks them itself."""
        return None

    def wait_refusal(self) -> Callable[[int, int], Exception | None] | None:
        """The engine's refusal of waits it can never serve, or None when it serves every
        location: ``refuse(module_index, kind)`` gives the error for such a wait (or None). A
        trace applies it at invoke to the waits a block's code is sure to make
        (:func:`asyncpp.locations.validate.check_block_paths`); the engine refuses the rest itself
        when they are made."""
        return None

    def submit(
        self, spec: RunSpec, post: Callable[..., Any], settle: Callable[[bool, Any], None]
    ) -> Callable[[], Any] | None:
        """Start a run off the caller's loop without awaiting it (streaming engines): when it has
        ended, ``post(fn, *args)`` (the loop's thread-safe entry point) brings ``settle(ok,
        outcome or error)`` to the caller's loop. May return a function that abandons the run."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")
