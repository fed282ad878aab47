"""What connects the nodes of a multi-node engine besides vLLM's own channels: authenticated,
and watched.

* **The stream channel.** On one node the driver's stream socket (``stream.py``) is an ``ipc://``
  path only this machine reaches. Across nodes it is TCP, and what arrives on it is unpickled: a
  connection must give the engine's secret (ZMQ's PLAIN mechanism, through pyzmq's
  authenticator) before any message of it is read. The secret is made by the driver and reaches
  the workers over vLLM's own RPC channel.
* **Links.** Every worker of a multi-node engine holds a TCP connection to the driver (a link:
  :class:`LinkServer`, :func:`hold_link`), which says nothing after its hello (the secret and the
  worker's rank). A link that ends means its other end is gone: a killed process's socket closes
  at once, and TCP keepalives drop a silent peer (a host that is gone) after about
  :data:`SILENT_S`. The driver then knows which worker it lost, on any host (the workers on its
  own host it also watches by pid); a worker of a headless node that loses its link ends its
  node, so that nothing stays behind a head node that has closed or died.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

USER = b"asyncpp"
SILENT_S = 10  # a link whose peer answers no TCP keepalive for this long is dropped
HELLO_S = 10  # a connection must give the secret within this


def new_secret() -> str:
    return secrets.token_hex(16)


def serve_securely(ctx: Any, sock: Any, secret: str) -> Any:
    """Make ``sock`` (not yet bound) accept only connections that give ``secret``; returns the
    authenticator (stop it when the socket is closed)."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_plain(domain="*", passwords={USER.decode(): secret})
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    return auth


def connect_securely(sock: Any, address: str, secret: str) -> None:
    """Connect ``sock`` to a socket made by :func:`serve_securely`."""
    import zmq

    sock.setsockopt(zmq.PLAIN_USERNAME, USER)
    sock.setsockopt(zmq.PLAIN_PASSWORD, secret.encode())
    sock.connect(address)


def tcp_endpoint(host: str) -> str:
    """The ``bind_to_random_port`` form of ``host`` (IPv6 in brackets)."""
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


def _keepalive(sock: socket.socket) -> None:
    """A peer that goes silent (its host is gone) is dropped after about :data:`SILENT_S`."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", SILENT_S - 2)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class LinkServer:
    """The driver's end of the workers' links: a TCP port each worker of a multi-node engine
    connects to and holds, after sending the engine's secret and its rank. ``on_lost(rank,
    peer)`` is called from the server's thread, once, when the first authenticated link ends.
    A connection that does not give the secret within :data:`HELLO_S` is closed, unread."""

    def __init__(self, host: str, secret: str, on_lost: Callable[[int, str], None]):
        self.on_lost = on_lost
        self._secret = secret.encode()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._stop_read, self._stop_write = socket.socketpair()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="asyncpp-links", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close every link without a call (the engine is closing)."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(OSError):
            self._stop_write.send(b"x")
        self._thread.join(5)

    def _run(self) -> None:
        links: dict[socket.socket, tuple[int, str]] = {}  # authenticated: socket -> (rank, peer)
        hello: dict[socket.socket, tuple[float, bytes]] = {}  # not yet: socket -> (since, read so far)
        want = len(self._secret) + 8
        try:
            while not self._stopped:
                ready, _, _ = select.select([self._stop_read, self._listener, *links, *hello], [], [], 1.0)
                now = time.monotonic()
                for sock in ready:
                    if sock is self._stop_read:
                        return
                    if sock is self._listener:
                        with contextlib.suppress(OSError):
                            conn, _ = self._listener.accept()
                            _keepalive(conn)
                            hello[conn] = (now, b"")
                        continue
                    try:
                        data = sock.recv(want)
                    except OSError:
                        data = b""
                    if sock in links:
                        if not data:  # the link ended: the worker, its node or the network is gone
                            rank, peer = links.pop(sock)
                            sock.close()
                            if not self._stopped:
                                self._stopped = True
                                self.on_lost(rank, peer)
                            return
                        continue
                    since, got = hello.pop(sock)
                    got += data
                    if data and len(got) < want:
                        hello[sock] = (since, got)
                    elif data and hmac.compare_digest(got[: len(self._secret)], self._secret):
                        links[sock] = (int(got[len(self._secret) :]), _peer(sock))
                    else:
                        sock.close()
                for sock, (since, _) in list(hello.items()):
                    if now - since > HELLO_S:
                        del hello[sock]
                        sock.close()
        finally:
            for sock in (*links, *hello, self._listener, self._stop_read, self._stop_write):
                with contextlib.suppress(OSError):
                    sock.close()


def hold_link(address: str, secret: str, rank: int, on_lost: Callable[[], None] | None) -> socket.socket:
    """A worker's end: connect to the driver's :class:`LinkServer` and hold the link; with
    ``on_lost``, a thread calls it if the link ends (the driver closed it, or is gone)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
    sock.settimeout(None)
    _keepalive(sock)
    sock.sendall(secret.encode() + b"%08d" % rank)
    if on_lost is not None:

        def wait() -> None:
            with contextlib.suppress(OSError):
                while sock.recv(64):
                    pass
            on_lost()

        threading.Thread(target=wait, name="asyncpp-link", daemon=True).start()
    return sock


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return ""
