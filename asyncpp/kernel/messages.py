"""The kernel's error messages: each names the location (module path and kind), the model's
position and what to do, and the traceback starts and ends in the user's code."""

from __future__ import annotations

from typing import Any

from .errors import ForeignAwaitError, NeverReachedError, OrderError
from .traps import GATHER, KIND_NAMES, READ, SLOT, WRITE, Read


def location_name(names: list[str], index: int, kind: int) -> str:
    path = names[index]
    return f"{path}.{KIND_NAMES[kind]}" if path else KIND_NAMES[kind]


def where(k: Any) -> str:
    """Where the model of interleaver ``k`` is, in words."""
    pos = k.position
    if isinstance(pos, str):
        return pos
    if isinstance(pos, Read):
        return pos.describe()
    if pos[0] == "step":
        return f"the start of step {pos[1]}"
    index, kind, n = pos
    return location_name(k.names, index, kind) + (f" (call {n})" if n else "")


def order_error(k: Any, trap: Read, step: int) -> OrderError:
    """``trap`` (at ``step``) can no longer be served: the model has passed it."""
    what = trap.describe()
    if k.finished or (k.current is not None and k.current.ended):
        return OrderError(
            f"{what} cannot be awaited: the run has ended (generation is over), so the model "
            f"will not run again in this trace"
        )
    if step < k.step:
        return OrderError(
            f"{what} of step {step} cannot be awaited: the model is already at {where(k)} (step {k.step})"
        )
    return OrderError(
        f"{what} has already passed in this run: the model is at {where(k)}. Await "
        f"locations in the order the model runs them, or use asyncpp.gather(...) to wait on "
        f"several at once"
    )


def never_reached(w: Any) -> NeverReachedError:
    """A wait of an earlier step that the model ran to its end without reaching."""
    trap = w.trap if w.trap.TRAP == READ else w.trap.target
    return NeverReachedError(
        f"{trap.describe()} was never reached in step {w.block.req_step}: the model ran that step to "
        f"the end without calling it (or not that many times)"
    )


def unfinished_wait(block: Any) -> NeverReachedError:
    """What ``block`` still waited on when its run ended."""
    trap = block.waiting
    kind = getattr(trap, "TRAP", None)
    if kind == READ or kind == WRITE:
        t = trap if kind == READ else trap.target
        msg = f"{t.describe()} was never reached: the run ended while the block waited on it"
        if block.req_step > 0:
            msg += f" (step {block.req_step})"
    elif kind == SLOT:
        msg = f"slot {trap.name!r} was never set: the run ended while the block waited on it"
    elif kind == GATHER:
        names = ", ".join(i.describe() if hasattr(i, "describe") else repr(i) for i in trap.items)
        msg = f"asyncpp.gather({names}) was not complete when the run ended"
    else:
        msg = "the run ended before the block finished"
    return NeverReachedError(msg)


def foreign(msg: Any) -> ForeignAwaitError:
    """A block awaited something that is not asyncpp's."""
    if msg is None:
        what = "a bare yield (such as asyncio.sleep() or anyio.sleep())"
    else:
        what = f"{type(msg).__module__}.{type(msg).__qualname__}"
    return ForeignAwaitError(
        f"an intervention block awaited {what}, which asyncpp cannot serve: blocks run inside the "
        f"model's forward pass, not on an event loop, so they can only await asyncpp locations, "
        f"steps, slots and asyncpp.gather(...). Do event-loop work before or after the trace."
    )


def user_traceback(tb: Any, internal: str) -> Any:
    """Drop asyncpp's frames before the block and after its ``await`` (the files under the folder
    ``internal``), so the traceback starts and ends in the user's code; all of it when every frame
    is asyncpp's (a block of asyncpp's own)."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename.startswith(internal):
        first = first.tb_next
    if first is None:
        return tb
    last_user = None
    cur = first
    while cur is not None:
        if cur.tb_frame.f_code.co_filename.startswith(internal):
            if last_user is not None and all(
                t.tb_frame.f_code.co_filename.startswith(internal) for t in _walk(cur)
            ):
                last_user.tb_next = None
                break
        else:
            last_user = cur
        cur = cur.tb_next
    return first


def _walk(tb: Any):
    while tb is not None:
        yield tb
        tb = tb.tb_next


__all__ = ["foreign", "location_name", "never_reached", "order_error", "unfinished_wait", "user_traceback"]
