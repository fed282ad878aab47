"""Cross-stage pull transport for pipeline parallelism.

Every pipeline stage runs the same user block.  When a block on one stage needs the value of a module
location that another stage owns, it *pulls* it from the owner: the owner *publishes* values on its
forward thread into a buffer, and a listener thread on each rank answers pulls.  The traffic runs on our
own gloo process group (one per TP column, group rank i == pipeline stage i), apart from the engine's.

Wire protocol (all on ``group``, with group-local ranks):

* Every message starts with a fixed-size int64 header of ``_HDR_WORDS`` words, sent with tag
  ``_TAG_HDR`` and received by the listener with ``recv_anysource``:
  ``[magic, kind, sender, req, key, tag, ticket, status, dtype, meta_words, payload_bytes, body_bytes]``.
* Kinds: PULL (requester -> owner), CANCEL (requester gave up: owner drops the waiting pull), REPLY
  (owner -> requester, echoes the ticket), DRAIN (request end, to every peer), BYE (last message a rank
  sends to a peer; the listener stops once every peer said BYE).
* A REPLY with ``body_bytes > 0`` is followed at once, by the same sender thread, by one uint8 body
  with tag ``_TAG_BODY``; the listener receives it from that source only.  An ok body is
  ``meta (int64 words, padded to 16 bytes) + payload`` where the payload is every tensor of the value,
  flattened into one buffer of its single true dtype; meta encodes the structure and shapes
  (``[LEAF, ndim, *shape]`` or ``[TUPLE|LIST, n, *children]``).  An error body is the UTF-8 message.
* Replies are routed to the waiting pull by ticket (unique per requester), so several pulls, from any
  number of threads, can be outstanding at once; a reply to an abandoned pull is read and dropped.

gloo send/recv is a rendezvous (a send completes only once the peer posted the matching recv), so all
sends of a rank go through one sender thread and the listener never sends: a listener only ever waits for
a header (from anyone) or for the body its sender is about to send, hence no cycle of waits.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernel.errors import AsyncppError

log = logging.getLogger(__name__)

__all__ = ["PullError", "PullTimeout", "PullService", "PullHandle"]


class PullError(AsyncppError, RuntimeError):
    """A pull that failed; the message names the location and the owner stage."""


class PullTimeout(PullError):
    """A pull (or a drain) whose deadline passed."""


_MAGIC = 0x41505050
_TAG_HDR = 0x5A50
_TAG_BODY = 0x5A51
_HDR_WORDS = 12
(
    _H_MAGIC,
    _H_KIND,
    _H_SENDER,
    _H_REQ,
    _H_KEY,
    _H_TAG,
    _H_TICKET,
    _H_STATUS,
    _H_DTYPE,
    _H_META,
    _H_PAYLOAD,
    _H_BODY,
) = range(_HDR_WORDS)
_HDR_BYTES = _HDR_WORDS * 8

_PULL, _CANCEL, _REPLY, _DRAIN, _BYE = 1, 2, 3, 4, 5
_OK, _ERR = 0, 1
_LEAF, _TUPLE, _LIST = 0, 1, 2

# recv waits use an explicit long timeout: a plain wait() would time out after the group's timeout while
# the engine is idle, and a timed-out gloo recv leaves the pair unusable.
_FOREVER = datetime.timedelta(days=365)
_MAX_ENDED = 4096
_MAX_MESSAGE = 1 << 16

# Same order on every rank (same torch build): the index is the wire code.
_DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        getattr(torch, name, None)
        for name in (
            "float32",
            "float64",
            "float16",
            "bfloat16",
            "uint8",
            "int8",
            "int16",
            "int32",
            "int64",
            "bool",
            "complex64",
            "complex128",
            "uint16",
            "uint32",
            "uint64",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
        )
    )
    if isinstance(d, torch.dtype)
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


class _Refused(Exception):
    """A value that cannot cross stages; the message says why."""


@dataclass
class _Entry:
    """One published value (or failure), already serialized: served as is, many times."""

    status: int
    dtype: int = 0
    meta_words: int = 0
    payload_bytes: int = 0
    body: torch.Tensor | None = None
    message: str = ""

    def header(self, sender: int, req: int, key: int, tag: int, ticket: int) -> torch.Tensor:
        body = 0 if self.body is None else self.body.numel()
        return _header(
            _REPLY,
            sender,
            req,
            key,
            tag,
            ticket,
            self.status,
            self.dtype,
            self.meta_words,
            self.payload_bytes,
            body,
        )


class _Slot:
    """A pull waiting for its reply on the requester side."""

    __slots__ = ("owner", "event", "header", "body", "error")

    def __init__(self, owner: int) -> None:
        self.owner = owner
        self.event = threading.Event()
        self.header: list[int] | None = None
        self.body: torch.Tensor | None = None
        self.error: str | None = None


class PullHandle:
    """A pull in flight, made by :meth:`PullService.request`."""

    __slots__ = ("service", "owner", "req", "key", "tag", "where", "ticket", "slot", "collected")

    def __init__(
        self,
        service: PullService,
        owner: int,
        req: int,
        key: int,
        tag: int,
        where: str,
        ticket: int,
        slot: _Slot | None,
    ) -> None:
        self.service = service
        self.owner, self.req, self.key, self.tag, self.where = owner, req, key, tag, where
        self.ticket = ticket
        self.slot = slot  # None: a pull from this rank itself
        self.collected = False  # waited on or cancelled

    def answered(self) -> bool:
        """Whether waiting on it now returns at once: the owner answered (with the value or an
        error), or the pull already failed."""
        if self.slot is None:
            return self.service._local_done(self.req, self.key, self.tag)
        return self.slot.event.is_set()


@dataclass
class _Out:
    """One message for the sender thread: a header and an optional body, sent back to back."""

    dst: int
    header: torch.Tensor
    body: torch.Tensor | None = None
    ctrl: bool = False
    reply: int = -1  # _OK / _ERR for replies (stats), -1 otherwise
    on_fail: Callable[[BaseException], None] | None = None


def _header(
    kind: int,
    sender: int,
    req: int = 0,
    key: int = 0,
    tag: int = 0,
    ticket: int = 0,
    status: int = 0,
    dtype: int = 0,
    meta_words: int = 0,
    payload_bytes: int = 0,
    body_bytes: int = 0,
) -> torch.Tensor:
    words = [
        _MAGIC,
        kind,
        sender,
        req,
        key,
        tag,
        ticket,
        status,
        dtype,
        meta_words,
        payload_bytes,
        body_bytes,
    ]
    return torch.tensor(words, dtype=torch.int64)


def _path(path: tuple[int, ...]) -> str:
    return "value" + "".join(f"[{i}]" for i in path)


def _error_entry(message: str) -> _Entry:
    data = message.encode("utf-8", "replace")[:_MAX_MESSAGE] or b"error"
    return _Entry(_ERR, body=torch.tensor(list(data), dtype=torch.uint8), message=message)


def _encode(value: Any) -> _Entry:
    """Serialize a tensor or a (nested) tuple/list of tensors of one dtype into one private CPU buffer."""
    meta: list[int] = []
    leaves: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def walk(v: Any, path: tuple[int, ...]) -> None:
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:
                raise _Refused(f"{_path(path)} is a {v.layout} tensor; only dense tensors can cross stages")
            meta.extend((_LEAF, v.dim(), *v.shape))
            leaves.append((path, v))
        elif isinstance(v, (tuple, list)):
            meta.extend((_TUPLE if isinstance(v, tuple) else _LIST, len(v)))
            for i, item in enumerate(v):
                walk(item, (*path, i))
        else:
            where = "the value" if not path else _path(path)
            raise _Refused(
                f"{where} is a {type(v).__name__}, not a tensor: only tensors and tuples/lists of "
                "tensors can cross stages"
            )

    walk(value, ())
    dtypes: dict[torch.dtype, tuple[int, ...]] = {}
    for path, leaf in leaves:
        dtypes.setdefault(leaf.dtype, path)
    if len(dtypes) > 1:
        kind = type(value).__name__
        listed = ", ".join(f"{d} at {_path(p)}" for d, p in dtypes.items())
        raise _Refused(
            f"the value is a {kind} with mixed dtypes ({listed}); a container must hold a single dtype to "
            "cross stages (pull its items separately or cast them to one dtype)"
        )
    dtype = next(iter(dtypes), torch.float32)
    if dtype not in _DTYPE_CODE:
        raise _Refused(f"dtype {dtype} cannot cross stages")
    if len(meta) % 2:
        meta.append(0)  # 16-byte aligned payload, so a view as any dtype is legal
    meta_bytes = 8 * len(meta)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = sum(leaf.numel() for _, leaf in leaves)
    body = torch.empty(meta_bytes + numel * itemsize, dtype=torch.uint8)
    body[:meta_bytes].view(torch.int64).copy_(torch.tensor(meta, dtype=torch.int64))
    payload = body[meta_bytes:].view(dtype)
    offset = 0
    for _, leaf in leaves:
        n = leaf.numel()
        payload[offset : offset + n].view(leaf.shape).copy_(leaf.detach())
        offset += n
    return _Entry(_OK, _DTYPE_CODE[dtype], len(meta), numel * itemsize, body)


def _decode(dtype_code: int, meta_words: int, payload_bytes: int, body: torch.Tensor) -> Any:
    """Rebuild the value from a body; the tensors are views of ``body``."""
    if not 0 <= dtype_code < len(_DTYPES):
        raise PullError(f"reply carries an unknown dtype code {dtype_code}")
    dtype = _DTYPES[dtype_code]
    meta_bytes = 8 * meta_words
    meta = body[:meta_bytes].view(torch.int64).tolist()
    payload = body[meta_bytes : meta_bytes + payload_bytes].view(dtype)
    pos = 0
    offset = 0

    def build() -> Any:
        nonlocal pos, offset
        kind, n = meta[pos], meta[pos + 1]
        pos += 2
        if kind == _LEAF:
            shape = meta[pos : pos + n]
            pos += n
            count = math.prod(shape)
            t = payload[offset : offset + count].view(shape)
            offset += count
            return t
        items = [build() for _ in range(n)]
        return tuple(items) if kind == _TUPLE else items

    return build()


def _message(body: torch.Tensor | None) -> str:
    return "" if body is None else bytes(body.tolist()).decode("utf-8", "replace")


class PullService:
    """One rank's end of the pull transport: a value buffer, a listener thread and a sender thread."""

    close_grace_s: float = 10.0  # how long close() waits for the peers' goodbyes

    def __init__(self, group: Any, rank: int, world: int, *, deadline_s: float = 60.0) -> None:
        """group: a gloo ProcessGroup whose members are the stages of one TP column, group rank i ==
        pipeline stage i. rank: this process's group rank; world: group size. deadline_s: how long a
        pull (or a drain) waits before giving up."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a group of {world}")
        size = getattr(group, "size", None)
        if callable(size) and size() != world:
            raise ValueError(f"the group has {size()} ranks, not {world}")
        grank = getattr(group, "rank", None)
        if callable(grank) and grank() != rank:
            raise ValueError(f"this process is rank {grank()} of the group, not {rank}")
        self.group = group
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
                "ctrl_bytes_in",  # drain / goodbye traffic
                "ctrl_bytes_out",
            ),
            0,
        )
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._values: dict[int, dict[tuple[int, int], _Entry]] = {}
        self._waiters: dict[int, dict[tuple[int, int], list[tuple[int, int]]]] = {}
        self._ended: dict[int, None] = {}  # requests cleared here (an ordered, bounded set)
        self._slots: dict[int, _Slot] = {}
        self._tickets = itertools.count(1)
        self._drains: dict[int, set[int]] = {}
        self._released: dict[int, None] = {}  # released here, waiting for the peers' DRAIN
        self._drain_abandoned: dict[int, None] = {}  # drains that gave up: their late DRAINs are dropped
        self._byes_in: set[int] = set()
        self._outbox: queue.SimpleQueue[_Out | None] = queue.SimpleQueue()
        self._listener: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._started = False
        self._closed = False
        self._broken: str | None = None

    def held(self) -> dict[str, int]:
        """Per-request state held now (for leak checks): buffered values, waiting pulls, drains."""
        with self._lock:
            return {
                "buffered": sum(len(v) for v in self._values.values()),
                "waiting": sum(len(w) for w in self._waiters.values()),
                "drains": len(self._drains) + len(self._released),
                "open_pulls": len(self._slots),
            }

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the listener and sender threads (daemons); a group of one needs neither."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
        if self.world == 1:
            return
        self._sender = threading.Thread(
            target=self._send_loop, name=f"asyncpp-pp-send-{self.rank}", daemon=True
        )
        self._listener = threading.Thread(
            target=self._listen_loop, name=f"asyncpp-pp-listen-{self.rank}", daemon=True
        )
        self._sender.start()
        self._listener.start()

    def close(self) -> None:
        """Stop serving: pending local pulls raise PullError, pulls waiting here get an error, and every
        peer gets a goodbye.  Idempotent.  Waits (up to ``close_grace_s``) for the peers' goodbyes, so the
        threads are gone when every rank closes; a rank closing alone leaves a daemon listener behind."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in self._slots.values():
                slot.error = f"the pull service of stage {self.rank} was closed"
                slot.event.set()
            self._slots.clear()
            waiting, self._waiters = self._waiters, {}
            self._values.clear()
            self._cv.notify_all()
            started = self._started and self.world > 1
        if not started:
            return
        for req, per_loc in waiting.items():
            for (key, tag), who in per_loc.items():
                entry = _error_entry(f"stage {self.rank} closed before it produced the value")
                for requester, ticket in who:
                    self._reply(requester, ticket, req, key, tag, entry)
        for peer in range(self.world):
            if peer != self.rank:
                self._post(_Out(peer, _header(_BYE, self.rank), ctrl=True))
        self._outbox.put(None)
        deadline = time.monotonic() + self.close_grace_s
        for thread in (self._sender, self._listener):
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._listener is not None and self._listener.is_alive():
            log.info("stage %d closed before every peer did; its listener stays until they do", self.rank)

    # ------------------------------------------------------------------ owner side

    def publish(self, req: int, key: int, tag: int, value: Any) -> None:
        """Store a private CPU copy of ``value`` (a tensor, or a possibly nested tuple/list of tensors of one
        dtype) under (req, key, tag) and answer the pulls already waiting for it.  A value that cannot
        cross stages (mixed dtypes, non-tensor items) is stored as an error for its pullers instead of
        raising here: the model thread must keep running."""
        try:
            entry = _encode(value)
        except _Refused as exc:
            entry = _error_entry(str(exc))
        except Exception as exc:  # a copy that failed: the pullers learn why, the forward goes on
            log.exception(
                "stage %d could not copy the value of req %d key %d tag %d", self.rank, req, key, tag
            )
            entry = _error_entry(f"the owner could not copy the value: {exc!r}")
        self._store(req, key, tag, entry)

    def fail(self, req: int, key: int, tag: int, message: str) -> None:
        """Pulls of (req, key, tag), waiting or future, are answered with ``message`` as an error."""
        self._store(req, key, tag, _error_entry(message))

    def _store(self, req: int, key: int, tag: int, entry: _Entry) -> None:
        with self._lock:
            if self._closed:
                return
            self._ended.pop(req, None)  # the request id is live again
            self._values.setdefault(req, {})[(key, tag)] = entry
            per_loc = self._waiters.get(req)
            who = per_loc.pop((key, tag), []) if per_loc else []
            if per_loc is not None and not per_loc:
                del self._waiters[req]
            self._cv.notify_all()
        for requester, ticket in who:
            self._reply(requester, ticket, req, key, tag, entry)

    def has(self, req: int, key: int, tag: int) -> bool:
        """Whether (req, key, tag) was published (or failed) on this rank and not cleared since."""
        with self._lock:
            return (key, tag) in self._values.get(req, {})

    def local(self, req: int, key: int, tag: int) -> Any:
        """A fresh copy of the value this rank published under (req, key, tag): the owner pulling from
        itself.  Raises PullError if it was failed, KeyError if nothing is there."""
        with self._lock:
            entry = self._values.get(req, {}).get((key, tag))
        if entry is None:
            raise KeyError(f"stage {self.rank} holds no value for request {req}, key {key}, tag {tag}")
        return self._open(entry, where=f"request {req} key {key} tag {tag}", owner=self.rank)

    def _announce_done(self, req: int) -> bool:
        """Tell every peer this rank is done with ``req`` (a DRAIN message); False when this service
        cannot send any more (closed or broken)."""
        with self._lock:
            usable = self._started and not self._closed and self._broken is None
        if usable:
            for peer in range(self.world):
                if peer != self.rank:
                    self._post(_Out(peer, _header(_DRAIN, self.rank, req), ctrl=True))
        return usable

    def release(self, req: int) -> None:
        """Request end without waiting: tell every peer this rank is done with ``req``; its buffer is
        cleared once every peer has said the same (at once if they already have), so no rank frees
        values another may still pull, and no rank waits on another's order of requests."""
        if self.world == 1:
            self.clear(req)
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
            self.clear(req)
        for (key, tag), who in waiting.items():
            entry = _error_entry(self._ended_message(req, key, tag))
            for requester, ticket in who:
                self._reply(requester, ticket, req, key, tag, entry)

    def clear(self, req: int) -> None:
        """Drop every buffered value of ``req`` on this rank; pulls still waiting here for one of its
        values are answered with an error, and later pulls of it fail at once (the last few thousand
        ended ids are remembered, so request ids must not be reused before a publish revives them)."""
        with self._lock:
            self._values.pop(req, None)
            waiting = self._waiters.pop(req, {})
            self._remember(self._ended, req)  # later pulls of it fail at once
            self._cv.notify_all()
        for (key, tag), who in waiting.items():
            entry = _error_entry(self._ended_message(req, key, tag))
            for requester, ticket in who:
                self._reply(requester, ticket, req, key, tag, entry)

    def drain(self, req: int) -> None:
        """Request end, called by every rank for the same ``req``: returns once every rank called
        drain(req), so no rank clears a buffer another may still pull from, then clear(req).  Each rank
        tells every peer it drained; no collective is involved, so any interleaving of requests is safe.
        Raises PullTimeout after ``deadline_s`` and PullError if a peer or this service closes first (the
        buffer is cleared either way)."""
        if self.world == 1:
            self.clear(req)
            return
        self._announce_done(req)
        peers = set(range(self.world)) - {self.rank}
        start = time.monotonic()
        problem: PullError | None = None
        with self._cv:
            while True:
                missing = peers - self._drains.get(req, set())
                if not missing:
                    break
                if self._closed or self._broken is not None or not self._started:
                    state = self._broken or ("closed" if self._closed else "not started")
                    problem = PullError(
                        f"drain of request {req} on stage {self.rank} failed: service {state}"
                    )
                    break
                gone = missing & self._byes_in
                if gone:
                    problem = PullError(
                        f"drain of request {req}: stage(s) {sorted(gone)} closed before draining it"
                    )
                    break
                left = start + self.deadline_s - time.monotonic()
                if left <= 0:
                    problem = PullTimeout(
                        f"drain of request {req} on stage {self.rank} timed out after {self.deadline_s:.1f} s "
                        f"waiting for stage(s) {sorted(missing)}"
                    )
                    break
                self._cv.wait(left)
            self._drains.pop(req, None)
            if problem is not None:
                self._remember(self._drain_abandoned, req)
        self.clear(req)
        if problem is not None:
            raise problem

    # ------------------------------------------------------------------ requester side

    def pull(self, owner: int, req: int, key: int, tag: int, *, where: str) -> Any:
        """Blocking: the value ``owner`` published under (req, key, tag), with its true dtype(s), shape(s)
        and tuple/list structure, as CPU tensors private to the caller.  If it is not published yet the
        owner answers when it is.  Errors raise PullError naming ``where`` and the owner; the deadline
        raises PullTimeout naming ``where``, the owner and the seconds waited.  The same as
        ``wait(request(...))``."""
        return self.wait(self.request(owner, req, key, tag, where=where))

    def request(self, owner: int, req: int, key: int, tag: int, *, where: str) -> PullHandle:
        """Non-blocking: send the pull of (req, key, tag) to ``owner`` now and return its handle, to
        check with ``handle.answered()``, collect with :meth:`wait` or give up with :meth:`cancel`.
        Raises PullError at once when the pull cannot be made (closed or broken service, closed
        owner)."""
        if not 0 <= owner < self.world:
            raise PullError(f"pull of {where}: stage {owner} is outside a pipeline of {self.world}")
        if owner == self.rank:
            return PullHandle(self, owner, req, key, tag, where, 0, None)
        with self._lock:
            trouble = self._trouble(owner)
            if trouble is None:
                ticket = next(self._tickets)
                slot = _Slot(owner)
                self._slots[ticket] = slot
                self.stats["pulls"] += 1
        if trouble is not None:
            raise PullError(f"pull of {where} from stage {owner} failed: {trouble}")

        def on_fail(exc: BaseException) -> None:
            self._fail_slot(ticket, f"could not send the pull: {exc}")

        self._post(_Out(owner, _header(_PULL, self.rank, req, key, tag, ticket), on_fail=on_fail))
        return PullHandle(self, owner, req, key, tag, where, ticket, slot)

    def wait(self, handle: PullHandle) -> Any:
        """Blocking: the value of a pull made with :meth:`request` (errors and the deadline, counted
        from this call, as for :meth:`pull`).  A handle is waited on once."""
        owner, where = handle.owner, handle.where
        if handle.collected:
            raise PullError(f"pull of {where} from stage {owner}: its handle was already used")
        handle.collected = True
        if handle.slot is None:
            return self._pull_local(handle.req, handle.key, handle.tag, where)
        slot, ticket = handle.slot, handle.ticket
        start = time.monotonic()
        answered = slot.event.wait(self.deadline_s)
        if not answered:
            with self._lock:
                gave_up = self._slots.pop(ticket, None) is not None
                if gave_up:
                    self.stats["timeouts"] += 1
            if gave_up:
                self._send_cancel(handle)
                waited = time.monotonic() - start
                raise PullTimeout(
                    f"pull of {where} from stage {owner} timed out after {waited:.1f} s "
                    f"(request {handle.req}, key {handle.key}, tag {handle.tag}): the owner never produced it"
                )
            # answered while we were giving up: the slot is filled, use it
        if slot.error is not None:
            raise PullError(f"pull of {where} from stage {owner} failed: {slot.error}")
        assert slot.header is not None
        h = slot.header
        if h[_H_STATUS] != _OK:
            raise PullError(f"pull of {where} from stage {owner} failed: {_message(slot.body)}")
        assert slot.body is not None
        return _decode(h[_H_DTYPE], h[_H_META], h[_H_PAYLOAD], slot.body)

    def cancel(self, handle: PullHandle) -> None:
        """Give up a pull that will not be waited on: the owner drops it if it is still waiting there
        (a reply already on its way is dropped on arrival).  Idempotent."""
        if handle.collected:
            return
        handle.collected = True
        if handle.slot is None:
            return
        with self._lock:
            open_ = self._slots.pop(handle.ticket, None) is not None
        if open_:
            self._send_cancel(handle)

    def _send_cancel(self, handle: PullHandle) -> None:
        """Tell the owner to drop a pull this rank gave up on."""
        self._post(
            _Out(handle.owner, _header(_CANCEL, self.rank, handle.req, handle.key, handle.tag, handle.ticket))
        )

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

    def _local_done(self, req: int, key: int, tag: int) -> bool:
        """Whether a pull from this rank itself would return (or fail) at once."""
        with self._lock:
            return (key, tag) in self._values.get(req, {}) or req in self._ended or self._closed

    def _pull_local(self, req: int, key: int, tag: int, where: str) -> Any:
        """The owner pulling from itself: wait (on a condition, not the wire) until it is published."""
        start = time.monotonic()
        with self._cv:
            self.stats["local_pulls"] += 1
            while True:
                entry = self._values.get(req, {}).get((key, tag))
                if entry is not None:
                    break
                if req in self._ended:
                    raise PullError(
                        f"pull of {where} from stage {self.rank} failed: "
                        + self._ended_message(req, key, tag)
                    )
                if self._closed:
                    raise PullError(f"pull of {where} from stage {self.rank} failed: the service is closed")
                left = start + self.deadline_s - time.monotonic()
                if left <= 0:
                    raise PullTimeout(
                        f"pull of {where} from stage {self.rank} (this stage) timed out after "
                        f"{time.monotonic() - start:.1f} s (request {req}, key {key}, tag {tag})"
                    )
                self._cv.wait(left)
        return self._open(entry, where=where, owner=self.rank)

    @staticmethod
    def _open(entry: _Entry, *, where: str, owner: int) -> Any:
        """A fresh copy of a locally stored value, or its error raised as PullError."""
        if entry.status != _OK:
            raise PullError(f"pull of {where} from stage {owner} failed: {entry.message}")
        assert entry.body is not None
        return _decode(entry.dtype, entry.meta_words, entry.payload_bytes, entry.body.clone())

    # ------------------------------------------------------------------ helpers

    def _ended_message(self, req: int, key: int, tag: int) -> str:
        return f"request {req} ended on stage {self.rank} before key {key}, tag {tag} was produced"

    @staticmethod
    def _remember(members: dict[int, None], req: int) -> None:
        """Add ``req`` to a bounded ordered set, forgetting the oldest (lock held)."""
        members.pop(req, None)
        members[req] = None
        while len(members) > _MAX_ENDED:
            del members[next(iter(members))]

    def _reply(self, requester: int, ticket: int, req: int, key: int, tag: int, entry: _Entry) -> None:
        header = entry.header(self.rank, req, key, tag, ticket)
        self._post(_Out(requester, header, entry.body, reply=entry.status))

    def _fail_slot(self, ticket: int, message: str) -> None:
        with self._lock:
            slot = self._slots.pop(ticket, None)
            if slot is not None:
                slot.error = message
                slot.event.set()

    def _post(self, out: _Out) -> None:
        """Queue a message for the sender thread.  It is counted now, so that once any API call returns,
        the counters include what it sent (the send itself may complete a little later)."""
        self._account(out, 1)
        self._outbox.put(out)

    def _account(self, out: _Out, sign: int) -> None:
        nbytes = _HDR_BYTES + (0 if out.body is None else out.body.numel())
        with self._lock:
            self.stats["ctrl_bytes_out" if out.ctrl else "bytes_out"] += sign * nbytes
            if out.reply == _OK:
                self.stats["served"] += sign
            elif out.reply == _ERR:
                self.stats["served_errors"] += sign

    # ------------------------------------------------------------------ threads

    def _send_loop(self) -> None:
        """The only thread that sends: header then body of one message, back to back, in queue order."""
        said_bye: set[int] = set()
        while True:
            out = self._outbox.get()
            if out is None:
                return
            if out.dst in said_bye:
                continue  # nothing may follow a goodbye: the peer's listener may be gone
            try:
                self.group.send([out.header], out.dst, _TAG_HDR).wait()
                if out.body is not None and out.body.numel() > 0:
                    self.group.send([out.body], out.dst, _TAG_BODY).wait()
            except Exception as exc:
                self._account(out, -1)  # it never left
                log.warning("stage %d could not send to stage %d: %s", self.rank, out.dst, exc)
                if out.on_fail is not None:
                    out.on_fail(exc)
                continue
            if int(out.header[_H_KIND]) == _BYE:
                said_bye.add(out.dst)

    def _listen_loop(self) -> None:
        """Receive headers from anyone (and the body after a reply header) until every peer said BYE."""
        peers = self.world - 1
        try:
            while True:
                with self._lock:
                    if len(self._byes_in) >= peers:
                        return
                header = torch.empty(_HDR_WORDS, dtype=torch.int64)
                work = self.group.recv_anysource([header], _TAG_HDR)
                work.wait(_FOREVER)
                h = header.tolist()
                src = h[_H_SENDER]  # (Work.source_rank() is deprecated; the header says who sent it)
                if h[_H_MAGIC] != _MAGIC or not 0 <= src < self.world or src == self.rank:
                    raise RuntimeError(f"stage {self.rank} got a malformed header: {h}")
                body = None
                if h[_H_KIND] == _REPLY and h[_H_BODY] > 0:
                    body = torch.empty(h[_H_BODY], dtype=torch.uint8)
                    self.group.recv([body], src, _TAG_BODY).wait(_FOREVER)
                self._dispatch(h, body)
        except Exception as exc:
            with self._lock:
                closed = self._closed
            if closed:
                log.debug("stage %d listener stopped after close: %s", self.rank, exc)
                return
            log.error("stage %d pull listener failed: %s", self.rank, exc)
            self._break(f"listener failed: {exc}")

    def _break(self, why: str) -> None:
        with self._lock:
            self._broken = why
            for slot in self._slots.values():
                slot.error = f"the transport of stage {self.rank} is broken: {why}"
                slot.event.set()
            self._slots.clear()
            self._cv.notify_all()

    def _dispatch(self, h: list[int], body: torch.Tensor | None) -> None:
        """Handle one message on the listener thread; never blocks on the wire (sends are queued)."""
        kind, src, req, key, tag, ticket = (
            h[_H_KIND],
            h[_H_SENDER],
            h[_H_REQ],
            h[_H_KEY],
            h[_H_TAG],
            h[_H_TICKET],
        )
        nbytes = _HDR_BYTES + (0 if body is None else body.numel())
        todo: _Entry | None = None
        released: int | None = None
        with self._lock:
            if kind in (_DRAIN, _BYE):
                self.stats["ctrl_bytes_in"] += nbytes
            else:
                self.stats["bytes_in"] += nbytes
            if kind == _REPLY:
                slot = self._slots.pop(ticket, None)
                if slot is None:
                    self.stats["late_replies"] += 1
                else:
                    slot.header = h
                    slot.body = body
                    slot.event.set()
            elif kind == _PULL:
                if self._closed:
                    return  # our goodbye is on its way: the requester fails the pull on it
                todo = self._values.get(req, {}).get((key, tag))
                if todo is None and (req in self._ended or req in self._released):
                    todo = _error_entry(self._ended_message(req, key, tag))
                if todo is None:
                    self._waiters.setdefault(req, {}).setdefault((key, tag), []).append((src, ticket))
            elif kind == _CANCEL:
                who = self._waiters.get(req, {}).get((key, tag))
                if who and (src, ticket) in who:
                    who.remove((src, ticket))
                    self.stats["cancels"] += 1
                    if not who:
                        del self._waiters[req][(key, tag)]
                        if not self._waiters[req]:
                            del self._waiters[req]
            elif kind == _DRAIN:
                if req not in self._drain_abandoned:  # else: the late half of a drain that gave up here
                    got = self._drains.setdefault(req, set())
                    got.add(src)
                    self._cv.notify_all()
                    if req in self._released and len(got) == self.world - 1:
                        released = req  # every peer is done with it too: clear it (below)
                        self._released.pop(req, None)
                        self._drains.pop(req, None)
            elif kind == _BYE:
                self._byes_in.add(src)
                for per_loc in self._waiters.values():  # its waiting pulls: nobody to answer any more
                    for who in per_loc.values():
                        who[:] = [(r, t) for r, t in who if r != src]
                for t, slot in list(self._slots.items()):
                    if slot.owner == src:
                        del self._slots[t]
                        slot.error = f"stage {src} closed its pull service"
                        slot.event.set()
                self._cv.notify_all()
            else:
                log.error("stage %d got an unknown message kind %d from stage %d", self.rank, kind, src)
        if todo is not None:
            self._reply(src, ticket, req, key, tag, todo)
        if released is not None:
            self.clear(released)
