"""The trap protocol: the only messages a block may yield to the interleaver.

A block suspends by awaiting one of these objects; each ``__await__`` yields the object itself, and
the interleaver dispatches on its ``TRAP`` code. Anything else that reaches the interleaver (an asyncio
future, a bare ``yield`` from ``asyncio.sleep(0)``) is foreign and is thrown back at the block's own
``await`` as :class:`~asyncpp.kernel.errors.ForeignAwaitError`.

Location kinds are small ints so that a wait key is one int: ``module_index * 4 + kind``.
"""

from __future__ import annotations

from typing import Any

INPUT = 0  # the first positional argument of a module call
INPUTS = 1  # (args, kwargs) of a module call
OUTPUT = 2  # the return value of a module call
SKIP = 3  # supply the output instead of running the module

KIND_NAMES = ("input", "inputs", "output", "skip")
KIND_CODES = {name: code for code, name in enumerate(KIND_NAMES)}

# trap codes (what the interleaver dispatches on)
READ, WRITE, STEP, SLOT, GATHER, PULL = range(6)  # PULL: a cross-stage value (asyncpp.pp)
BACKWARD, GRAD = 6, 7  # a backward pass a block drives, and a gradient at a location (kernel.grad)


class Read:
    """Wait for a module location and receive its value (narrowed to the block's rows).

    ``occ`` is the call number within the block's current step; ``keys`` index into the value (an
    element of a tuple output); ``key`` is the wait key ``index * 4 + kind``.
    """

    TRAP = READ
    __slots__ = ("index", "kind", "occ", "keys", "path", "key")

    def __init__(self, index: int, kind: int, path: str, occ: int = 0, keys: tuple = ()):
        self.index = index
        self.kind = kind
        self.path = path
        self.occ = occ
        self.keys = keys
        self.key = index * 4 + kind

    def __await__(self):
        return (yield self)

    def describe(self) -> str:
        """Human name of this location, as used in every error message."""
        name = f"{self.path}.{KIND_NAMES[self.kind]}" if self.path else KIND_NAMES[self.kind]
        for k in self.keys:
            name += f"[{k!r}]"
        if self.occ:
            name += f" (call {self.occ})"
        return name


class Write:
    """Replace the value at a location (or skip a module, for kind ``SKIP``) when it is reached."""

    TRAP = WRITE
    __slots__ = ("target", "value", "line", "awaited")

    def __init__(self, target: Read, value: Any, line: str):
        self.target = target
        self.value = value
        self.line = line
        self.awaited = False

    def __await__(self):
        self.awaited = True
        return (yield self)


class StepGate:
    """Wait until the model starts generation step ``>= after``: a step loop's next iteration.

    One gate serves every iteration of its loop: the interleaver resumes the block with the step
    number the gate opens at and sets ``after`` past it, or throws ``StopAsyncIteration`` (the
    loop ends) once generation has ended or the selection is used up."""

    TRAP = STEP
    __slots__ = ("steps", "after", "every")

    def __init__(self, steps, after: int, every: bool = False):
        self.steps = steps  # the selection (``first_at_or_after(step)``) that owns this gate
        self.after = after  # first step number this gate may open on
        self.every = every  # the loop selects every step (the native fast path parks these)

    def __await__(self):
        return (yield self)


class Gather:
    """Wait on several reads (or slots) at once; resumes with a list once all have arrived."""

    TRAP = GATHER
    __slots__ = ("items",)

    def __init__(self, items: tuple):
        self.items = items

    def __await__(self):
        return (yield self)
