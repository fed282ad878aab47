"""The wires under the cross-stage pull service (:mod:`asyncpp.pp.pulls`): what moves a message's
bytes from one stage to another.

A wire connects every pair of ranks of one pull group. It posts a message (a header and an optional
body, :mod:`asyncpp.pp.pull_format`) without ever waiting for the peer, and hands a listener thread
the next header of one peer and then that message's body. Two wires:

* :class:`SocketWire` (the default): one TCP connection per pair of ranks, its addresses exchanged
  over the pull group itself. A post is one ``sendmsg`` call from the posting thread; whatever the
  socket does not take at once goes, in order, to a writer thread of that peer, so no thread ever
  blocks on a full socket. A listener reads its peer's bytes as they arrive. A connection opens
  only with the accepting rank's secret, which went to the group's members alone.
* :class:`GlooWire`: gloo send/recv on the group (a rendezvous: a send completes only once the peer
  posted the matching receive, so a completion thread waits for the posted sends). Two to eight times
  slower per pull on two cores (docs/performance.md); ``ASYNCPP_PP_WIRE=gloo`` selects it.

Bodies cross as raw bytes (any buffer): the sender's are not copied, the receiver's arrive in a
fresh ``bytearray`` that the decoded value's tensors then view. A lost connection (a peer process
gone) ends its listener's ``receive`` with :class:`WireClosed`.
"""

from __future__ import annotations

import collections
import datetime
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from . import pull_format as fmt

__all__ = ["Wire", "SocketWire", "GlooWire", "WireClosed", "make_wire", "WIRE_ENV"]

WIRE_ENV = "ASYNCPP_PP_WIRE"  # "tcp" (default) or "gloo"
WIRES = ("tcp", "gloo")

OnFail = Callable[[BaseException], None]

# recv waits use an explicit long timeout: a plain wait() would time out after the group's timeout while
# the engine is idle, and a timed-out gloo recv leaves the pair unusable.
_FOREVER = datetime.timedelta(days=365)
_HELLO = struct.Struct("<qq16s")  # magic, the connecting rank, the accepting rank's secret
_CONNECT_S = 120.0  # how long the ranks of a group wait for each other's connections


class WireClosed(ConnectionError):
    """The connection to a peer ended (the peer closed it, or its process is gone)."""


class Wire:
    """What the pull service needs of a transport (see the module docstring)."""

    def open(self) -> None:
        """Connect to every peer (every rank of the group calls it, collectively)."""

    def post(self, dst: int, header: bytes, body: fmt.Buffer | None, on_fail: OnFail) -> None:
        """Send one message (its header's bytes, its body's) now, without waiting for the peer; the
        body must stay unchanged until sent. Raises if it cannot be sent at all; ``on_fail`` is
        called (from another thread) if it fails later."""
        raise NotImplementedError

    def receive_header(self, peer: int) -> list[int]:
        """Blocking: the next message header from ``peer``, as its words."""
        raise NotImplementedError

    def receive_body(self, peer: int, nbytes: int) -> bytearray:
        """Blocking: the body (``nbytes`` bytes) of the message whose header was just received."""
        raise NotImplementedError

    def flush(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until what was posted has left, then stop sending."""

    def shutdown(self) -> None:
        """End every connection: listeners still receiving get :class:`WireClosed`."""


def make_wire(group: Any, rank: int, world: int, kind: str | None = None, host: str = "127.0.0.1") -> Wire:
    """The wire named by ``kind`` (default: ``$ASYNCPP_PP_WIRE``, else ``"tcp"``) for this group."""
    kind = (kind or os.environ.get(WIRE_ENV) or "tcp").strip().lower()
    if kind == "tcp":
        return SocketWire(group, rank, world, host)
    if kind == "gloo":
        return GlooWire(group, rank, world)
    raise ValueError(f"{WIRE_ENV}={kind!r}: the pull wires are {', '.join(WIRES)}")


# --------------------------------------------------------------------------------------------- gloo


class GlooWire(Wire):
    """Messages as gloo send/recv on the pull group (a message and its body up to 64 KiB: one gloo
    message with :data:`~asyncpp.pp.pull_format.TAG_HEADER`; a longer body: a second one)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self._posted: queue.SimpleQueue[tuple[OnFail, list[Any]] | None] = queue.SimpleQueue()
        self._frames = {p: torch.empty(fmt.FRAME_BYTES, dtype=torch.uint8) for p in range(world) if p != rank}
        self._completer = threading.Thread(target=self._complete, name=f"asyncpp-pp-send-{rank}", daemon=True)

    def open(self) -> None:
        self._completer.start()

    def post(self, dst: int, header: bytes, body: fmt.Buffer | None, on_fail: OnFail) -> None:
        works: list[Any] = []
        try:
            if body is not None and fmt.inline(len(body)):  # one message: header, then body
                frame = torch.frombuffer(bytearray(header) + body, dtype=torch.uint8)
                works.append(self.group.send([frame], dst, fmt.TAG_HEADER))
            else:
                works.append(self.group.send([_tensor_of(header)], dst, fmt.TAG_HEADER))
                if body is not None:
                    works.append(self.group.send([_tensor_of(body)], dst, fmt.TAG_BODY))
        finally:
            # what was posted must be waited for, even after an error (reported by the raise)
            self._posted.put((on_fail, works))

    def receive_header(self, peer: int) -> list[int]:
        frame = self._frames[peer]
        self.group.recv([frame], peer, fmt.TAG_HEADER).wait(_FOREVER)
        return list(fmt.HEADER.unpack(frame[: fmt.HEADER_BYTES].numpy()))

    def receive_body(self, peer: int, nbytes: int) -> bytearray:
        if fmt.inline(nbytes):
            return bytearray(fmt.buffer_of(self._frames[peer])[fmt.HEADER_BYTES : fmt.HEADER_BYTES + nbytes])
        body = bytearray(nbytes)
        self.group.recv([torch.frombuffer(body, dtype=torch.uint8)], peer, fmt.TAG_BODY).wait(_FOREVER)
        return body

    def flush(self, timeout: float) -> None:
        self._posted.put(None)
        if self._completer.is_alive():
            self._completer.join(timeout)

    def _complete(self) -> None:
        """Wait for every posted send to complete, in posting order (a send's buffers live until it
        has), and report the ones that failed."""
        while True:
            item = self._posted.get()
            if item is None:
                return
            on_fail, works = item
            try:
                for work in works:
                    work.wait()
            except Exception as exc:
                on_fail(exc)


# ---------------------------------------------------------------------------------------------- tcp


_INBOX_BYTES = 1 << 16  # what one receive call may take from a connection at once


class _Peer:
    """One connection: what its writer thread still has to send, in order, and what was received
    from it and not yet taken (``inbox[lo:hi]``; one receive call takes as many messages as have
    arrived)."""

    __slots__ = ("peer", "sock", "backlog", "cv", "writer", "closing", "inbox", "view", "lo", "hi")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.backlog: collections.deque[tuple[memoryview, OnFail]] = collections.deque()
        self.cv = threading.Condition()
        self.writer: threading.Thread | None = None
        self.closing = False
        self.inbox = bytearray(_INBOX_BYTES)
        self.view = memoryview(self.inbox)
        self.lo = self.hi = 0

    def have(self, n: int) -> None:
        """Receive until at least ``n`` (at most the inbox's size) bytes are waiting in the inbox."""
        if self.hi - self.lo >= n:
            return
        if self.lo:  # move what is left to the front, making room behind it (via a copy: they overlap)
            self.inbox[: self.hi - self.lo] = bytes(self.view[self.lo : self.hi])
            self.hi -= self.lo
            self.lo = 0
        while self.hi < n:
            self.hi += _receive_into(self.sock, self.view[self.hi :], self.peer)

    def take_into(self, out: memoryview) -> None:
        """Fill ``out`` with the next bytes: first what the inbox holds, then from the socket."""
        got = min(len(out), self.hi - self.lo)
        out[:got] = self.view[self.lo : self.lo + got]
        self.lo += got
        while got < len(out):
            got += _receive_into(self.sock, out[got:], self.peer)


class SocketWire(Wire):
    """One TCP connection per pair of ranks (see the module docstring). ``host``: the address this
    rank listens on and its peers connect to (loopback when every rank is on one host)."""

    def __init__(self, group: Any, rank: int, world: int, host: str = "127.0.0.1") -> None:
        self.group, self.rank, self.world, self.host = group, rank, world, host
        self._peers: dict[int, _Peer] = {}

    # --- connecting

    def open(self) -> None:
        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server = socket.create_server((self.host, 0), family=family, backlog=max(8, self.world))
        try:
            secret = secrets.token_bytes(16)
            mine = (self.host, server.getsockname()[1], secret)
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(everyone, mine, group=self.group)
            deadline = time.monotonic() + _CONNECT_S
            for peer in range(self.rank):  # connect to every lower rank, then accept every higher one
                host, port, theirs = everyone[peer]
                sock = socket.create_connection((host, port), timeout=max(1.0, deadline - time.monotonic()))
                sock.sendall(_HELLO.pack(fmt.MAGIC, self.rank, theirs))
                self._add(peer, sock)
            waiting = set(range(self.rank + 1, self.world))
            while waiting:
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    raise ConnectionError(
                        f"pull wire of stage {self.rank}: stages {sorted(waiting)} did not connect "
                        f"within {_CONNECT_S:.0f} s"
                    ) from None
                peer = self._hello(sock, secret, waiting)
                if peer is None:
                    sock.close()  # not one of the group's stages: ignored
                    continue
                waiting.discard(peer)
                self._add(peer, sock)
        except BaseException:
            self.shutdown()
            raise
        finally:
            server.close()

    def _hello(self, sock: socket.socket, secret: bytes, waiting: set[int]) -> int | None:
        """The rank that connected, or None when it is not a stage of this group."""
        try:
            sock.settimeout(5.0)
            data = _read_exactly(sock, _HELLO.size)
            magic, peer, theirs = _HELLO.unpack(data)
        except (OSError, WireClosed, struct.error):
            return None
        if magic != fmt.MAGIC or theirs != secret or peer not in waiting:
            return None
        return peer

    def _add(self, peer: int, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[peer] = _Peer(peer, sock)

    # --- sending

    def post(self, dst: int, header: bytes, body: fmt.Buffer | None, on_fail: OnFail) -> None:
        p = self._peers[dst]
        parts = [memoryview(header)]
        if body is not None:
            parts.append(memoryview(body).cast("B"))
        with p.cv:
            if p.closing:
                raise WireClosed(f"the pull wire to stage {dst} is closed")
            sent = 0
            if not p.backlog:  # nothing queued before it: straight into the socket, if it takes it
                try:
                    sent = p.sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
            rest = _after(parts, sent)
            if rest:
                p.backlog.extend((part, on_fail) for part in rest)
                if p.writer is None:
                    p.writer = threading.Thread(
                        target=self._write,
                        args=(dst, p),
                        name=f"asyncpp-pp-write-{self.rank}-{dst}",
                        daemon=True,
                    )
                    p.writer.start()
                p.cv.notify()

    def _write(self, dst: int, p: _Peer) -> None:
        """The peer's writer: send the backlog in order, blocking on the socket as it must."""
        while True:
            with p.cv:
                while not p.backlog and not p.closing:
                    p.cv.wait()
                if not p.backlog:
                    return
                part, on_fail = p.backlog[0]
            try:
                p.sock.sendall(part)
            except OSError as exc:
                with p.cv:
                    failed = {id(f): f for _, f in p.backlog}
                    p.backlog.clear()
                    p.closing = True
                    p.cv.notify_all()
                for f in failed.values():
                    f(exc)
                return
            with p.cv:
                p.backlog.popleft()
                p.cv.notify_all()

    # --- receiving

    def receive_header(self, peer: int) -> list[int]:
        p = self._peers[peer]
        p.have(fmt.HEADER_BYTES)
        words = fmt.HEADER.unpack_from(p.inbox, p.lo)
        p.lo += fmt.HEADER_BYTES
        return list(words)

    def receive_body(self, peer: int, nbytes: int) -> bytearray:
        p = self._peers[peer]
        if nbytes <= p.hi - p.lo:  # arrived with its header (the common case)
            body = bytearray(p.view[p.lo : p.lo + nbytes])
            p.lo += nbytes
            return body
        body = bytearray(nbytes)
        p.take_into(memoryview(body))
        return body

    # --- closing

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self._peers.values():
            with p.cv:
                while p.backlog and time.monotonic() < deadline:
                    p.cv.wait(max(0.0, deadline - time.monotonic()))
                p.closing = True
                p.cv.notify_all()

    def shutdown(self) -> None:
        for p in self._peers.values():
            with p.cv:
                p.closing = True
                p.backlog.clear()
                p.cv.notify_all()
            try:
                p.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            p.sock.close()


def _tensor_of(data: fmt.Buffer) -> torch.Tensor:
    """Bytes as a uint8 tensor for gloo (no copy where the buffer is writable)."""
    view = memoryview(data)
    return torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)


def _after(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What of ``parts`` is left once their first ``sent`` bytes have gone."""
    rest: list[memoryview] = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        rest.append(part[sent:])
        sent = 0
    return rest


def _receive_into(sock: socket.socket, view: memoryview, peer: int) -> int:
    """One receive into ``view`` (blocking until something arrives): how many bytes came."""
    try:
        k = sock.recv_into(view)
    except OSError as exc:
        raise WireClosed(f"the connection to stage {peer} failed: {exc}") from None
    if k == 0:
        raise WireClosed(f"stage {peer} closed its connection")
    return k


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        got += _receive_into(sock, view[got:], -1)
    return bytes(buf)
