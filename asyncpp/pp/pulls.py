"""The cross-stage pull service of pipeline parallelism.

Every pipeline stage runs the same user block. When a block on one stage needs the value of a module
location that another stage owns, it *pulls* it from the owner: the owner *publishes* values on its
forward thread into a buffer, and listener threads on each rank answer pulls. The traffic runs on our
own gloo process group (one per TP column, group rank i == pipeline stage i), apart from the engine's.
A value is addressed by (req, key, visit); the messages and their encoding are in
:mod:`asyncpp.pp.pull_format`. A pull may carry a *selection* (indexing, a standard view): the owner
applies it and ships only that part.

Replies are routed to the waiting pull by ticket (unique per requester), so several pulls, from any
number of threads, can be outstanding at once; a reply to an abandoned pull is read and dropped.

The bytes travel on a wire (:mod:`asyncpp.pp.pull_wire`): by default one TCP connection per pair of
stages, set up over the group; ``ASYNCPP_PP_WIRE=gloo`` sends them as gloo messages on the group
instead. No thread ever waits for its own send: whichever thread makes a message (the block's, asking
for a value; the listener, answering one) posts it at once, under one lock, and the wire never waits
for the peer to take it. Each rank runs one listener thread per peer, which only ever waits for that
peer's next header or for the body that follows it, hence no cycle of waits, and a pull crosses with
no thread hand-off on the sending sides. A peer's listener stops once that peer said BYE; a peer whose
connection ends without a BYE breaks the service (its process is gone).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..kernel.errors import AsyncppError
from . import pull_format as fmt
from .pull_wire import WireClosed, make_wire

log = logging.getLogger(__name__)

__all__ = ["PullError", "PullTimeout", "PullService", "PullHandle"]


class PullError(AsyncppError, RuntimeError):
    """A pull that failed; the message names the location and the owner stage."""


class PullTimeout(PullError):
    """A pull whose deadline passed."""


_MAX_ENDED = 4096
_CONTROL = frozenset((fmt.DRAIN, fmt.BYE))  # kinds counted as control traffic, not pull traffic

# the pulls waiting at an owner for the values of one request:
# (key, visit) -> [(requester, ticket, selection)]
_Waiting = dict[tuple[int, int], list[tuple[int, int, tuple]]]


@functools.lru_cache(maxsize=256)
def _selection(body: bytes) -> tuple:
    """A PULL's selection (a block pulls with a few distinct ones: each is read once)."""
    return fmt.decode_selection(fmt.words_of(body))


class _PendingPull:
    """A pull waiting for its reply on the requester side. It is finished once (by whoever takes it
    out of the service's open pulls), which releases its latch, a lock held from the start: the
    cheapest one-shot wake-up there is."""

    __slots__ = ("owner", "latch", "done", "header", "body", "error")

    def __init__(self, owner: int) -> None:
        self.owner = owner
        self.latch = threading.Lock()
        self.latch.acquire()
        self.done = False
        self.header: fmt.Header | None = None
        self.body: bytearray | None = None
        self.error: str | None = None

    def finish(self, error: str | None = None) -> None:
        if error is not None:
            self.error = error
        self.done = True
        self.latch.release()

    def wait(self, timeout: float) -> bool:
        return self.done or self.latch.acquire(timeout=max(0.0, timeout))


class PullHandle:
    """A pull in flight, made by :meth:`PullService.request`."""

    __slots__ = (
        "service",
        "owner",
        "req",
        "key",
        "visit",
        "where",
        "ticket",
        "pending",
        "collected",
        "select",
        "made",
    )

    def __init__(
        self,
        service: PullService,
        owner: int,
        req: int,
        key: int,
        visit: int,
        where: str,
        ticket: int,
        pending: _PendingPull | None,
        select: tuple = (),
    ) -> None:
        self.service = service
        self.owner, self.req, self.key, self.visit, self.where = owner, req, key, visit, where
        self.ticket = ticket
        self.pending = pending  # None: a pull from this rank itself
        self.collected = False  # waited on or cancelled
        self.select = select  # the selection the value comes back with (pull_format's operations)
        self.made = time.perf_counter()

    def answered(self) -> bool:
        """Whether waiting on it now returns at once: the owner answered (with the value or an
        error), or the pull already failed."""
        if self.pending is None:
            return self.service._local_done(self.req, self.key, self.visit)
        return self.pending.done


@dataclass
class _Out:
    """One message: a header and an optional body, posted back to back."""

    dst: int
    header: bytes
    body: fmt.Buffer | None = None
    ctrl: bool = False
    reply: int = -1  # OK / ERR for replies (stats), -1 otherwise
    on_fail: Callable[[BaseException], None] | None = None

    @property
    def kind(self) -> int:
        return fmt.HEADER.unpack(self.header)[fmt.H_KIND]


class PullService:
    """One rank's end of the pull transport: a value buffer, a listener thread per peer and a sender
    thread."""

    close_grace_s: float = 10.0  # how long close() waits for the peers' goodbyes

    def __init__(
        self,
        group: Any,
        rank: int,
        world: int,
        *,
        deadline_s: float = 60.0,
        wire: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        """group: a gloo ProcessGroup whose members are the stages of one TP column, group rank i ==
        pipeline stage i. rank: this process's group rank; world: group size. deadline_s: how long a
        pull waits before giving up. wire: "tcp" or "gloo" (default: ``$ASYNCPP_PP_WIRE``, else
        "tcp"); host: the address this rank's TCP wire listens on (reachable by every peer)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a group of {world}")
        size = getattr(group, "size", None)
        if callable(size) and size() != world:
            raise ValueError(f"the group has {size()} ranks, not {world}")
        grank = getattr(group, "rank", None)
        if callable(grank) and grank() != rank:
            raise ValueError(f"this process is rank {grank()} of the group, not {rank}")
        self._wire = make_wire(group, rank, world, wire, host)
        self.rank = rank
        self.world = world
        self.deadline_s = float(deadline_s)
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "pulls",  # remote pulls made by this rank
                "local_pulls",  # pulls of values this rank owns
                "served",  # ok replies sent
                "served_errors",  # error replies sent
                "timeouts",
                "cancels",  # waiting pulls dropped because their requester gave up
                "late_replies",  # replies for pulls that had already given up
                "bytes_in",  # pull traffic (requests, cancels, replies: header + body)
                "bytes_out",
                "value_bytes_in",  # of which the values' own bytes (ok replies' tensor data)
                "waited",  # remote pulls collected with their value
                "wait_us",  # their time from the request to the value in hand, summed
                "ctrl_bytes_in",  # drain / goodbye traffic
                "ctrl_bytes_out",
            ),
            0,
        )
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._values: dict[int, dict[tuple[int, int], fmt.Encoded]] = {}
        self._waiters: dict[int, _Waiting] = {}
        self._ended: dict[int, None] = {}  # requests cleared here (an ordered, bounded set)
        self._pending: dict[int, _PendingPull] = {}  # by ticket
        self._tickets = itertools.count(1)
        self._drains: dict[int, set[int]] = {}  # the peers that said they are done with a request
        self._released: dict[int, None] = {}  # released here, waiting for the peers' DRAIN
        self._byes_in: set[int] = set()
        self._send_lock = threading.Lock()  # posts a message's header and body back to back
        self._said_bye: set[int] = set()  # peers sent a goodbye: nothing may follow it
        self._listeners: list[threading.Thread] = []  # one per peer
        self._started = False
        self._closed = False
        self._broken: str | None = None
        # the listeners' handler of each message kind: called with the lock held, returns what to do
        # once the lock is released (replies to send), or None
        self._handlers: dict[int, Callable[[fmt.Header, bytearray | None], Callable[[], None] | None]] = {
            fmt.PULL: self._on_pull,
            fmt.CANCEL: self._on_cancel,
            fmt.REPLY: self._on_reply,
            fmt.DRAIN: self._on_drain,
            fmt.BYE: self._on_bye,
        }

    def held(self) -> dict[str, int]:
        """Per-request state held now (for leak checks): buffered values, waiting pulls, drains."""
        with self._lock:
            return {
                "buffered": sum(len(v) for v in self._values.values()),
                "waiting": sum(len(w) for w in self._waiters.values()),
                "drains": len(self._drains) + len(self._released),
                "open_pulls": len(self._pending),
            }

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Connect the wire (every rank of the group calls this: it is collective) and start a
        listener thread per peer (daemons); a group of one needs none."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
        if self.world == 1:
            return
        self._wire.open()
        self._listeners = [
            threading.Thread(
                target=self._listen_loop,
                args=(peer,),
                name=f"asyncpp-pp-listen-{self.rank}-{peer}",
                daemon=True,
            )
            for peer in range(self.world)
            if peer != self.rank
        ]
        for listener in self._listeners:
            listener.start()

    def close(self) -> None:
        """Stop serving: pending local pulls raise PullError, pulls waiting here get an error, and every
        peer gets a goodbye.  Idempotent.  Waits (up to ``close_grace_s``) for the peers' goodbyes, so the
        threads are gone when every rank closes; then ends the connections (on the gloo wire a rank
        closing alone leaves daemon listeners behind)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for pending in self._pending.values():
                pending.finish(f"the pull service of stage {self.rank} was closed")
            self._pending.clear()
            waiting, self._waiters = self._waiters, {}
            self._values.clear()
            self._cv.notify_all()
            started = self._started and self.world > 1
        if not started:
            return
        for req, per_loc in waiting.items():
            for (key, visit), who in per_loc.items():
                entry = fmt.error_body(f"stage {self.rank} closed before it produced the value")
                for requester, ticket, _ in who:
                    self._reply(requester, ticket, req, key, visit, entry)
        for peer in range(self.world):
            if peer != self.rank:
                self._post(_Out(peer, fmt.header_bytes(fmt.BYE, self.rank), ctrl=True))
        deadline = time.monotonic() + self.close_grace_s
        self._wire.flush(self.close_grace_s)
        for thread in self._listeners:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if any(listener.is_alive() for listener in self._listeners):
            log.info("stage %d closed before every peer said goodbye", self.rank)
        self._wire.shutdown()

    # ------------------------------------------------------------------ owner side

    def publish(self, req: int, key: int, visit: int, value: Any) -> None:
        """Store a private CPU copy of ``value`` (tensors, constants, and tuples, lists and dicts of
        them: :func:`~asyncpp.pp.pull_format.encode`) under (req, key, visit) and answer the pulls
        already waiting for it. A value that cannot cross stages (another object) is stored as an
        error for its pullers instead of raising here: the model thread must keep running."""
        try:
            entry = fmt.encode(value)
        except fmt.Refused as exc:
            entry = fmt.error_body(str(exc))
        except Exception as exc:  # a copy that failed: the pullers learn why, the forward goes on
            log.exception(
                "stage %d could not copy the value of req %d key %d visit %d", self.rank, req, key, visit
            )
            entry = fmt.error_body(f"the owner could not copy the value: {exc!r}")
        self._store(req, key, visit, entry)

    def fail(self, req: int, key: int, visit: int, message: str) -> None:
        """Pulls of (req, key, visit), waiting or future, are answered with ``message`` as an error."""
        self._store(req, key, visit, fmt.error_body(message))

    def _store(self, req: int, key: int, visit: int, entry: fmt.Encoded) -> None:
        with self._lock:
            if self._closed:
                return
            self._ended.pop(req, None)  # the request id is live again
            self._values.setdefault(req, {})[(key, visit)] = entry
            per_loc = self._waiters.get(req)
            who = per_loc.pop((key, visit), []) if per_loc else []
            if per_loc is not None and not per_loc:
                del self._waiters[req]
            self._cv.notify_all()
        for requester, ticket, select in who:
            self._reply(requester, ticket, req, key, visit, fmt.select(entry, select))

    def _announce_done(self, req: int) -> bool:
        """Tell every peer this rank is done with ``req`` (a DRAIN message); False when this service
        cannot send any more (closed or broken)."""
        with self._lock:
            usable = self._started and not self._closed and self._broken is None
        if usable:
            for peer in range(self.world):
                if peer != self.rank:
                    self._post(_Out(peer, fmt.header_bytes(fmt.DRAIN, self.rank, req), ctrl=True))
        return usable

    def release(self, req: int) -> None:
        """Request end without waiting: tell every peer this rank is done with ``req``; its buffer is
        cleared once every peer has said the same (at once if they already have), so no rank frees
        values another may still pull, and no rank waits on another's order of requests."""
        if self.world == 1:
            self._clear(req)
            return
        usable = self._announce_done(req)
        with self._lock:
            done = len(self._drains.get(req, ())) == self.world - 1 or not usable
            if done:
                self._drains.pop(req, None)
                waiting = {}
            else:
                self._released[req] = None
                # this stage produces nothing more for the request: pulls waiting here for a
                # value it never published are answered now (its buffered values stay servable)
                waiting = self._waiters.pop(req, {})
        if done:
            self._clear(req)
        self._answer_ended(req, waiting)

    def _clear(self, req: int) -> None:
        """Drop every buffered value of ``req`` on this rank; pulls still waiting here for one of its
        values are answered with an error, and later pulls of it fail at once (the last few thousand
        ended ids are remembered, so request ids must not be reused before a publish revives them)."""
        with self._lock:
            waiting = self._forget(req)
        self._answer_ended(req, waiting)

    def _forget(self, req: int) -> _Waiting:
        """(lock held) Drop the values of ``req``, remember that it ended, and hand back the pulls
        still waiting for them (to answer with :meth:`_answer_ended` once the lock is released)."""
        self._values.pop(req, None)
        waiting = self._waiters.pop(req, {})
        self._remember(self._ended, req)  # later pulls of it fail at once
        self._cv.notify_all()
        return waiting

    def _answer_ended(self, req: int, waiting: _Waiting) -> None:
        for (key, visit), who in waiting.items():
            entry = fmt.error_body(self._ended_message(req, key, visit))
            for requester, ticket, _ in who:
                self._reply(requester, ticket, req, key, visit, entry)

    # ------------------------------------------------------------------ requester side

    def pull(self, owner: int, req: int, key: int, visit: int, *, where: str, select: tuple = ()) -> Any:
        """Blocking: the value ``owner`` published under (req, key, visit), with its true dtype(s),
        shape(s) and tuple/list structure, as CPU tensors private to the caller; with a selection
        (``pull_format``'s operations), that part of it, which the owner selects.  If it is not
        published yet the owner answers when it is.  Errors raise PullError naming ``where`` and the
        owner; the deadline raises PullTimeout naming ``where``, the owner and the seconds waited; a
        selection that does not apply to the value raises as it would applied here.  The same as
        ``wait(request(...))``."""
        return self.wait(self.request(owner, req, key, visit, where=where, select=select))

    def request(
        self, owner: int, req: int, key: int, visit: int, *, where: str, select: tuple = ()
    ) -> PullHandle:
        """Non-blocking: send the pull of (req, key, visit) (with its selection) to ``owner`` now
        and return its handle, to check with ``handle.answered()``, collect with :meth:`wait` or
        give up with :meth:`cancel`.  Raises PullError at once when the pull cannot be made (closed
        or broken service, closed owner)."""
        if not 0 <= owner < self.world:
            raise PullError(f"pull of {where}: stage {owner} is outside a pipeline of {self.world}")
        if owner == self.rank:
            return PullHandle(self, owner, req, key, visit, where, 0, None, select)
        body = fmt.encode_selection(select) if select else None
        with self._lock:
            trouble = self._trouble(owner)
            if trouble is None:
                ticket = next(self._tickets)
                pending = _PendingPull(owner)
                self._pending[ticket] = pending
                self.stats["pulls"] += 1
        if trouble is not None:
            raise PullError(f"pull of {where} from stage {owner} failed: {trouble}")

        def on_fail(exc: BaseException) -> None:
            self._fail_pending(ticket, f"could not send the pull: {exc}")

        nbytes = 0 if body is None else len(body)
        head = fmt.header_bytes(fmt.PULL, self.rank, req, key, visit, ticket, body_bytes=nbytes)
        self._post(_Out(owner, head, body, on_fail=on_fail))
        return PullHandle(self, owner, req, key, visit, where, ticket, pending, select)

    def wait(self, handle: PullHandle) -> Any:
        """Blocking: the value of a pull made with :meth:`request` (errors and the deadline, counted
        from this call, as for :meth:`pull`).  A handle is waited on once."""
        owner, where = handle.owner, handle.where
        if handle.collected:
            raise PullError(f"pull of {where} from stage {owner}: its handle was already used")
        handle.collected = True
        if handle.pending is None:
            return fmt.apply_selection(
                self._pull_local(handle.req, handle.key, handle.visit, where), handle.select
            )
        pending, ticket = handle.pending, handle.ticket
        start = time.monotonic()
        answered = pending.wait(self.deadline_s)
        if not answered:
            with self._lock:
                gave_up = self._pending.pop(ticket, None) is not None
                if gave_up:
                    self.stats["timeouts"] += 1
            if gave_up:
                self._send_cancel(handle)
                waited = time.monotonic() - start
                raise PullTimeout(
                    f"pull of {where} from stage {owner} timed out after {waited:.1f} s (request "
                    f"{handle.req}, key {handle.key}, visit {handle.visit}): the owner never produced it"
                )
            # answered while we were giving up: the reply is there, use it
        if pending.error is not None:
            raise PullError(f"pull of {where} from stage {owner} failed: {pending.error}")
        h = pending.header
        assert h is not None
        if h.status == fmt.ERR:
            raise PullError(f"pull of {where} from stage {owner} failed: {fmt.error_message(pending.body)}")
        assert pending.body is not None
        try:
            value = fmt.decode(h.dtype, h.meta_words, h.payload_bytes, pending.body)
        except fmt.WireError as exc:
            raise PullError(f"pull of {where} from stage {owner} failed: {exc}") from None
        if h.status == fmt.WHOLE:  # the owner could not select: it fails here as on one stage
            value = fmt.apply_selection(value, handle.select)
        took = int((time.perf_counter() - handle.made) * 1e6)
        with self._lock:
            self.stats["waited"] += 1
            self.stats["wait_us"] += took
        return value

    def cancel(self, handle: PullHandle) -> None:
        """Give up a pull that will not be waited on: the owner drops it if it is still waiting there
        (a reply already on its way is dropped on arrival).  Idempotent."""
        if handle.collected:
            return
        handle.collected = True
        if handle.pending is None:
            return
        with self._lock:
            open_ = self._pending.pop(handle.ticket, None) is not None
        if open_:
            self._send_cancel(handle)

    def _send_cancel(self, handle: PullHandle) -> None:
        """Tell the owner to drop a pull this rank gave up on."""
        cancel = fmt.header_bytes(fmt.CANCEL, self.rank, handle.req, handle.key, handle.visit, handle.ticket)
        self._post(_Out(handle.owner, cancel))

    def _trouble(self, owner: int) -> str | None:
        """Why a pull from ``owner`` cannot be made now (lock held), or None."""
        if self._closed:
            return f"the pull service of stage {self.rank} is closed"
        if self._broken is not None:
            return f"the transport of stage {self.rank} is broken: {self._broken}"
        if not self._started:
            return f"the pull service of stage {self.rank} was not started"
        if owner in self._byes_in:
            return f"stage {owner} has closed its pull service"
        return None

    def _local_done(self, req: int, key: int, visit: int) -> bool:
        """Whether a pull from this rank itself would return (or fail) at once."""
        with self._lock:
            return (key, visit) in self._values.get(req, {}) or req in self._ended or self._closed

    def _pull_local(self, req: int, key: int, visit: int, where: str) -> Any:
        """The owner pulling from itself: wait (on a condition, not the wire) until it is published."""
        start = time.monotonic()
        with self._cv:
            self.stats["local_pulls"] += 1
            while True:
                entry = self._values.get(req, {}).get((key, visit))
                if entry is not None:
                    break
                if req in self._ended:
                    raise PullError(
                        f"pull of {where} from stage {self.rank} failed: "
                        + self._ended_message(req, key, visit)
                    )
                if self._closed:
                    raise PullError(f"pull of {where} from stage {self.rank} failed: the service is closed")
                left = start + self.deadline_s - time.monotonic()
                if left <= 0:
                    raise PullTimeout(
                        f"pull of {where} from stage {self.rank} (this stage) timed out after "
                        f"{time.monotonic() - start:.1f} s (request {req}, key {key}, visit {visit})"
                    )
                self._cv.wait(left)
        return self._open(entry, where=where, owner=self.rank)

    @staticmethod
    def _open(entry: fmt.Encoded, *, where: str, owner: int) -> Any:
        """A fresh copy of a locally stored value, or its error raised as PullError."""
        if entry.status != fmt.OK:
            raise PullError(f"pull of {where} from stage {owner} failed: {entry.message}")
        return fmt.decode_copy(entry)

    # ------------------------------------------------------------------ helpers

    def _ended_message(self, req: int, key: int, visit: int) -> str:
        return f"request {req} ended on stage {self.rank} before key {key}, visit {visit} was produced"

    @staticmethod
    def _remember(members: dict[int, None], req: int) -> None:
        """Add ``req`` to a bounded ordered set, forgetting the oldest (lock held)."""
        members.pop(req, None)
        members[req] = None
        while len(members) > _MAX_ENDED:
            del members[next(iter(members))]

    def _reply(self, requester: int, ticket: int, req: int, key: int, visit: int, entry: fmt.Encoded) -> None:
        header = entry.reply_header(self.rank, req, key, visit, ticket)
        self._post(_Out(requester, header, entry.data(), reply=entry.status))

    def _fail_pending(self, ticket: int, message: str) -> None:
        with self._lock:
            pending = self._pending.pop(ticket, None)
            if pending is not None:
                pending.finish(message)

    def _post(self, out: _Out) -> None:
        """Post a message now (the wire never waits for the peer to take it).  It is counted now, so
        that once any API call returns, the counters include what it sent."""
        self._account(out, 1)
        with self._send_lock:
            if out.dst in self._said_bye:
                return  # nothing may follow a goodbye: the peer's listener may be gone
            body = out.body if out.body else None
            try:
                self._wire.post(out.dst, out.header, body, partial(self._failed, out))
            except Exception as exc:
                error: BaseException | None = exc
            else:
                error = None
                if out.ctrl and out.kind == fmt.BYE:
                    self._said_bye.add(out.dst)
        if error is not None:
            self._failed(out, error)

    def _failed(self, out: _Out, exc: BaseException) -> None:
        self._account(out, -1)  # it never left
        with self._lock:
            gone = out.dst in self._byes_in or self._closed
        # (a peer that said goodbye may have ended its connection: what we still had for it is moot)
        log.log(
            logging.DEBUG if gone else logging.WARNING,
            "stage %d could not send to stage %d: %s",
            self.rank,
            out.dst,
            exc,
        )
        if out.on_fail is not None:
            out.on_fail(exc)

    def _account(self, out: _Out, sign: int) -> None:
        nbytes = fmt.HEADER_BYTES + (0 if out.body is None else len(out.body))
        with self._lock:
            self.stats["ctrl_bytes_out" if out.ctrl else "bytes_out"] += sign * nbytes
            if out.reply == fmt.OK:
                self.stats["served"] += sign
            elif out.reply == fmt.ERR:
                self.stats["served_errors"] += sign

    # ------------------------------------------------------------------ threads

    def _listen_loop(self, peer: int) -> None:
        """Receive the messages of one peer (a header, and its body) until it said BYE."""
        wire = self._wire
        try:
            while peer not in self._byes_in:  # (a set's membership needs no lock)
                h = self._parse(wire.receive_header(peer), peer)
                body = None
                if h.kind in (fmt.REPLY, fmt.PULL) and h.body_bytes > 0:
                    body = wire.receive_body(peer, h.body_bytes)
                self._dispatch(h, body)
        except Exception as exc:
            with self._lock:
                closed = self._closed
            if closed:
                log.debug("stage %d listener stopped after close: %s", self.rank, exc)
                return
            why = str(exc) if isinstance(exc, WireClosed) else f"listener failed: {exc}"
            log.error("stage %d pull listener of stage %d failed: %s", self.rank, peer, why)
            self._break(why)

    def _parse(self, words: list[int], peer: int) -> fmt.Header:
        """A received header, checked; a malformed one stops the listener (the stream is lost)."""
        try:
            h = fmt.read_header(words)
        except fmt.UnknownKind as exc:
            h = exc.header  # dispatched, and there logged and dropped: the stream itself is intact
        except fmt.WireError as exc:
            raise RuntimeError(f"stage {self.rank} got a malformed header: {exc}") from None
        if h.sender != peer:
            raise RuntimeError(f"stage {self.rank} got a malformed header (sender {h.sender}): {words}")
        return h

    def _break(self, why: str) -> None:
        with self._lock:
            self._broken = why
            for pending in self._pending.values():
                pending.finish(f"the transport of stage {self.rank} is broken: {why}")
            self._pending.clear()
            self._cv.notify_all()

    def _dispatch(self, h: fmt.Header, body: bytearray | None) -> None:
        """Handle one message on the listener thread; never blocks on the wire (sends are queued)."""
        nbytes = fmt.HEADER_BYTES + (0 if body is None else len(body))
        handler = self._handlers.get(h.kind, self._on_unknown)
        with self._lock:
            self.stats["ctrl_bytes_in" if h.kind in _CONTROL else "bytes_in"] += nbytes
            then = handler(h, body)
        if then is not None:
            then()

    # the handlers, one per message kind (lock held; what they return runs once it is released)

    def _on_reply(self, h: fmt.Header, body: bytearray | None) -> None:
        pending = self._pending.pop(h.ticket, None)
        if pending is None:
            self.stats["late_replies"] += 1
            return
        pending.header = h
        pending.body = body
        if h.status != fmt.ERR:
            self.stats["value_bytes_in"] += h.payload_bytes
        pending.finish()

    def _on_pull(self, h: fmt.Header, body: bytearray | None) -> Callable[[], None] | None:
        if self._closed:
            return None  # our goodbye is on its way: the requester fails the pull on it
        req, at = h.req, (h.key, h.visit)
        try:
            select = _selection(bytes(body)) if body is not None else ()
        except fmt.WireError as exc:
            entry = fmt.error_body(f"stage {self.rank} could not read the pull's selection: {exc}")
            return partial(self._reply, h.sender, h.ticket, req, h.key, h.visit, entry)
        entry = self._values.get(req, {}).get(at)
        if entry is None and (req in self._ended or req in self._released):
            entry = fmt.error_body(self._ended_message(req, h.key, h.visit))
        if entry is None:
            self._waiters.setdefault(req, {}).setdefault(at, []).append((h.sender, h.ticket, select))
            return None
        return lambda: self._reply(h.sender, h.ticket, req, h.key, h.visit, fmt.select(entry, select))

    def _on_cancel(self, h: fmt.Header, body: bytearray | None) -> None:
        per_loc = self._waiters.get(h.req, {})
        at = (h.key, h.visit)
        who = per_loc.get(at)
        mine = [w for w in who or () if w[:2] == (h.sender, h.ticket)]
        if mine:
            who.remove(mine[0])
            self.stats["cancels"] += 1
            if not who:
                del per_loc[at]
                if not per_loc:
                    del self._waiters[h.req]

    def _on_drain(self, h: fmt.Header, body: bytearray | None) -> Callable[[], None] | None:
        req = h.req
        got = self._drains.setdefault(req, set())
        got.add(h.sender)
        self._cv.notify_all()
        if req not in self._released or len(got) < self.world - 1:
            return None
        # released here and every peer is done with it too: clear it
        self._released.pop(req, None)
        self._drains.pop(req, None)
        return partial(self._answer_ended, req, self._forget(req))

    def _on_bye(self, h: fmt.Header, body: bytearray | None) -> None:
        src = h.sender
        self._byes_in.add(src)
        for per_loc in self._waiters.values():  # its waiting pulls: nobody to answer any more
            for who in per_loc.values():
                who[:] = [w for w in who if w[0] != src]
        for ticket, pending in list(self._pending.items()):
            if pending.owner == src:
                del self._pending[ticket]
                pending.finish(f"stage {src} closed its pull service")
        self._cv.notify_all()

    def _on_unknown(self, h: fmt.Header, body: bytearray | None) -> None:
        log.error("stage %d got an unknown message kind %d from stage %d", self.rank, h.kind, h.sender)
