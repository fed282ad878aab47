"""Values blocks stream from vLLM's workers (``asyncpp.emit``), live, over a channel of their own.

The driver binds a ZMQ PULL socket (``ipc://`` in a temporary folder) on the engine's event loop;
after the engine has started, every worker is told its address and the senders connect a PUSH
socket to it. A block's ``asyncpp.emit(value)`` then sends the value at once from inside the
forward (ZMQ queues it; the forward does not wait), without waiting for the engine step to end or
for the request's outcome to be collected.

* **Who sends.** Tensor-parallel rank 0 of every pipeline stage. The other tensor-parallel ranks
  run the same block and pickle the same value (so that a value that does not pickle fails the
  block at the same line on every rank) but send nothing: no duplicates.
* **Pipeline parallel.** Every stage runs every block, so every stage emits every value, with
  what it holds: a value is first converted as a result is (remote values this stage does not own
  become ``NOT_HERE``), and the driver merges the stages' n-th values of a request with the same
  rules as results (:func:`asyncpp.pp.merge.merge`) once every stage has sent its n-th.
* **Messages.** Pairs of frames (one pair, or the ends of a step's finished requests together): a
  text header ``kind|stage|n|request id`` and a payload. ``v``: the
  n-th value of a request, pickled with cloudpickle (this channel is internal to the engine's own
  processes). ``e``: the request is over on that stage, after n values; its payload is the
  stage's packed outcome of the request's block (``packing.pack_outcome``). A worker sends ``e``
  when it finishes the request's block (when vLLM reports the request finished, or when the driver
  collects a request early) and when the driver collects a request it does not hold. One socket is
  FIFO, so once every sender's ``e`` has arrived, all of the request's values have, and the
  request's outcome is known without asking the workers: no round trip between engine steps.
  ``m``: a step mark, for requests whose caller follows their tokens live: the payload lists
  ``request id=steps`` (``;``-separated), how many engine steps each request of a step has run,
  sent once the step's forward and sampling are done. A token reaches the driver through vLLM's
  engine core, a path of its own, and could overtake the values its step emitted; the driver
  passes token k on only once step k is marked on every stage (:meth:`Receiver.caught_up`), and
  the mark, on the same FIFO socket, comes after every value of the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle

from ...pp.merge import NOT_HERE, merge
from . import links
from .packing import RemoteBlockError

VALUE, END, MARK = "v", "e", "m"


def _header(kind: str, stage: int, n: int, aid: str) -> bytes:
    return f"{kind}|{stage}|{n}|{aid}".encode()


def _parse(header: bytes) -> tuple[str, int, int, str]:
    kind, stage, n, aid = header.decode().split("|", 3)
    return kind, int(stage), int(n), aid


# --- the worker's side -----------------------------------------------------------------------------


class Sender:
    """A worker's end of the channel: sends only where ``sends`` (TP rank 0 of its stage)."""

    def __init__(self):
        self.stage = 0
        self._sock: Any = None
        self._ctx: Any = None
        self.sent = 0  # messages sent (stats)
        self._held: list | None = None  # ends kept to go as one message (see hold)

    def connect(self, address: str, stage: int, sends: bool, secret: str | None = None) -> None:
        """Connect to the driver's :class:`Receiver` (``secret``: a multi-node engine's)."""
        self.stage = stage
        if not sends or self._sock is not None:
            return
        import zmq

        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block the forward: queue whatever the driver has not read
        sock.setsockopt(zmq.LINGER, 2000)  # at exit, give queued messages a moment, then go
        if secret is None:
            sock.connect(address)
        else:
            links.connect_securely(sock, address, secret)
        self._sock = sock

    def value(self, aid: str, n: int, value: Any) -> None:
        """Send the request's ``n``-th value; a value that does not pickle raises here, in the
        block, at its ``asyncpp.emit`` line."""
        try:
            payload = cloudpickle.dumps(value)
        except Exception as err:
            raise RemoteBlockError(
                f"asyncpp.emit(): the value could not be sent from the worker to the caller: {err!r}"
            ) from None
        if self._sock is not None:
            self._sock.send_multipart([_header(VALUE, self.stage, n, aid), payload], copy=False)
            self.sent += 1

    def end(self, aid: str, count: int, outcome: bytes) -> None:
        """The request is over here after ``count`` values; ``outcome`` is its packed outcome."""
        if self._sock is None:
            return
        frames = [_header(END, self.stage, count, aid), outcome]
        if self._held is not None:
            self._held += frames
            return
        self._sock.send_multipart(frames, copy=False)
        self.sent += 1

    def mark(self, marks: list[tuple[str, int]]) -> None:
        """The step is over for these live requests: ``(request id, steps it has run)``."""
        if self._sock is None:
            return
        payload = ";".join(f"{aid}={steps}" for aid, steps in marks).encode()
        self._sock.send_multipart([_header(MARK, self.stage, 0, ""), payload], copy=False)
        self.sent += 1

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Send the ends given inside as one message, at the end (a step's finished requests:
        one wake-up of the socket's thread instead of one per request)."""
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            frames, self._held = self._held, None
            if frames and self._sock is not None:
                self._sock.send_multipart(frames, copy=False)
                self.sent += 1


# --- the driver's side -----------------------------------------------------------------------------


class Stream:
    """What the driver holds of one request's values until its outcome is settled."""

    __slots__ = (
        "sink", "index", "values", "parts", "next", "got", "outcomes", "done", "error", "marked", "waiter",
    )  # fmt: skip

    def __init__(self, sink: Callable[[int, Any], None] | None, index: int, stages: int, done: Any):
        self.sink = sink
        self.index = index  # the invoke's index in its trace (what the sink is called with)
        self.values: list = []  # delivered, in order: the invoke's ``emitted``
        self.parts: dict[int, list] = {}  # pipeline parallel: n -> each stage's n-th value
        self.next = 0  # pipeline parallel: the next n to merge and deliver
        self.got = [0] * stages  # values received per stage
        self.outcomes: list[bytes | None] = [None] * stages  # each stage's packed outcome, at its end
        self.done = done  # an asyncio future: every stage's end has arrived
        self.error: BaseException | None = None  # a value that could not be received
        self.marked = [0] * stages  # (live) steps each stage has marked done for this request
        self.waiter: tuple[int, Any] | None = None  # (steps, future): caught_up waits for them

    def caught_up(self, steps: int) -> bool:
        """Every stage has marked ``steps`` steps done (or ended the request): all the values those
        steps emitted have been received."""
        return all(o is not None or m >= steps for o, m in zip(self.outcomes, self.marked))

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and self.caught_up(waiter[0]) and not waiter[1].done():
            waiter[1].set_result(None)

    @property
    def ended(self) -> bool:
        """Every stage has said the request is over (and sent its outcome)."""
        return None not in self.outcomes


class Receiver:
    """The driver's end: one PULL socket, read on the engine's event loop whenever its file
    descriptor says messages have come (and by :meth:`drain` before a request's new tokens go on),
    which hands each value to its request's stream. Create and use on that loop.

    One reader only, in order: a second reader on the same socket (an asyncio task awaiting a
    message beside :meth:`drain`) could hold a step's value while the step's mark is handled."""

    def __init__(self, stages: int, host: str | None = None):
        """``host``: a multi-node engine's, the address of this node the other nodes reach (TCP,
        authenticated: see ``links.py``); None: one node (``ipc://``)."""
        import zmq

        self.stages = stages
        self.streams: dict[str, Stream] = {}  # asyncpp request id -> its stream
        self.received = 0  # messages (stats)
        self._dir = tempfile.mkdtemp(prefix="asyncpp-")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._auth = None
        #: what a worker needs to connect besides the address (None on one node)
        self.secret: str | None = None
        if host is None:
            self.address = f"ipc://{os.path.join(self._dir, uuid.uuid4().hex[:8])}"
            self._sock.bind(self.address)
        else:
            self.secret = links.new_secret()
            self._auth = links.serve_securely(self._ctx, self._sock, self.secret)
            if ":" in host:
                self._sock.setsockopt(zmq.IPV6, 1)
            port = self._sock.bind_to_random_port(links.tcp_endpoint(host))
            self.address = f"{links.tcp_endpoint(host)}:{port}"
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self._loop = asyncio.get_running_loop()
        # ZMQ's descriptor is edge-triggered: each wake-up reads until nothing is left
        self._fd = self._sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self.drain)
        self._loop.call_soon(self.drain)

    def open(self, aid: str, sink: Callable[[int, Any], None] | None, index: int) -> Stream:
        stream = Stream(sink, index, self.stages, self._loop.create_future())
        self.streams[aid] = stream
        return stream

    def drop(self, aid: str) -> None:
        stream = self.streams.pop(aid, None)
        if stream is not None and not stream.done.done():
            stream.done.cancel()

    def has_ended(self, aid: str) -> bool:
        """Whether every stage's end of this (open) request has arrived."""
        stream = self.streams.get(aid)
        return stream is not None and stream.ended

    async def caught_up(self, stream: Stream, steps: int, patience: float = 10.0) -> None:
        """Wait until the request's first ``steps`` steps are marked done on every stage (see the
        module's ``m`` messages), so that their values are delivered before their tokens. It also
        takes what has arrived itself, at growing intervals (up to 10 ms), should a wake-up of
        the reader be missed. Past ``patience`` seconds it stops waiting (the engine's own failure handling sees
        a dead worker): it never hangs a stream."""
        self.drain()
        if stream.caught_up(steps):
            return
        future = self._loop.create_future()
        stream.waiter = (steps, future)
        deadline = self._loop.time() + patience
        pause = 0.0005
        try:
            while not future.done() and self._loop.time() < deadline:
                await asyncio.wait((future,), timeout=pause)
                self.drain()
                pause = min(pause * 2, 0.01)
        finally:
            stream.waiter = None

    async def ended(self, streams: list[Stream], patience: float = 30.0) -> None:
        """Wait until every stage's end of these requests has arrived (the workers send it the
        engine step after the request's last output, or when the driver collects it). Messages
        still coming in count as progress; ``patience`` seconds without any is an error, not a
        hang."""
        self.drain()
        pending = [s.done for s in streams if not s.done.done()]
        loop = self._loop
        progress, seen = loop.time(), self.received
        while pending:
            _, still = await asyncio.wait(pending, timeout=0.1)
            self.drain()  # (should a wake-up of the reader be missed)
            pending = [f for f in still if not f.done()]
            if self.received != seen:
                progress, seen = loop.time(), self.received
            if pending and loop.time() - progress > patience:
                raise RuntimeError(
                    f"asyncpp: the end of {len(pending)} request(s) did not arrive from vLLM's workers "
                    f"within {patience:.0f} s of their last output"
                )

    def drain(self) -> None:
        """Take every message already received, now (on the engine's loop)."""
        sock, again, noblock = self._sock, self._again, self._noblock
        if sock.closed:  # (a wake-up that was already scheduled when the engine closed)
            return
        while True:
            try:
                frames = sock.recv_multipart(noblock, copy=True)
            except again:
                return
            self._handle(frames)

    def _handle(self, frames: list) -> None:
        self.received += 1
        for i in range(0, len(frames) - 1, 2):  # (header, payload) pairs: one or several
            try:
                self._take(*_parse(frames[i]), frames[i + 1])
            except Exception:  # pragma: no cover - a malformed message must not stop the reader
                pass

    def _take(self, kind: str, stage: int, n: int, aid: str, payload: bytes) -> None:
        if kind == MARK:
            self._mark(stage, payload)
            return
        stream = self.streams.get(aid)
        if stream is None:  # a request whose caller has gone (cancelled, dropped): nobody listens
            return
        if kind == END:
            if stream.outcomes[stage] is not None:  # a second end (collected as it finished)
                return
            stream.outcomes[stage] = payload
            if stream.got[stage] != n and stream.error is None:
                stream.error = RemoteBlockError(
                    f"pipeline stage {stage} sent {n} streamed values of this request, the caller "
                    f"received {stream.got[stage]}"
                )
            if stream.ended:
                self._flush(stream, last=True)
                if not stream.done.done():
                    stream.done.set_result(None)
            stream.wake()
            return
        stream.got[stage] += 1
        try:
            value = pickle.loads(payload)
        except Exception as err:
            value = None
            if stream.error is None:
                stream.error = RemoteBlockError(
                    f"a value the block streamed (asyncpp.emit) could not be received: {err!r}"
                )
        if self.stages == 1:
            self._deliver(stream, value)
            return
        parts = stream.parts.get(n)
        if parts is None:
            parts = stream.parts[n] = [NOT_HERE] * (self.stages + 1)
            parts[-1] = 0  # how many stages have sent their n-th
        parts[stage] = value
        parts[-1] += 1
        self._flush(stream, last=False)

    def _mark(self, stage: int, payload: bytes) -> None:
        streams = self.streams
        for entry in payload.decode().split(";"):
            aid, _, steps = entry.rpartition("=")
            stream = streams.get(aid)
            if stream is not None:
                stream.marked[stage] = max(stream.marked[stage], int(steps))
                stream.wake()

    def _flush(self, stream: Stream, last: bool) -> None:
        """Pipeline parallel: merge and deliver the values every stage has sent, in order (at the
        end, also those some stage never sent: what it would have held is not there)."""
        parts = stream.parts
        while parts:
            entry = parts.get(stream.next)
            if entry is None:
                if not last:
                    return
                stream.next = min(parts)
                continue
            if entry[-1] < self.stages and not last:
                return
            del parts[stream.next]
            stream.next += 1
            try:
                merged = merge(entry[:-1], where="emitted value")
            except Exception as err:
                merged = None
                if stream.error is None:
                    stream.error = err
            self._deliver(stream, None if merged is NOT_HERE else merged)

    def _deliver(self, stream: Stream, value: Any) -> None:
        stream.values.append(value)
        if stream.sink is not None:
            try:
                stream.sink(stream.index, value)
            except Exception:  # pragma: no cover - the caller's side must not stop the reader
                pass

    async def close(self) -> None:
        self._loop.remove_reader(self._fd)
        for aid in list(self.streams):
            self.drop(aid)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
