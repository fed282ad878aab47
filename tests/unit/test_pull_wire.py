"""The TCP pull wire's framing on a real socket pair: what one side posts, the other receives,
message by message, however the bytes are cut into receive calls (tests/pp runs it between
processes)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from asyncpp.pp import pull_format as fmt
from asyncpp.pp.pull_wire import SocketWire, WireClosed


def _pair() -> tuple[SocketWire, SocketWire, socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:  # loopback TCP, as the wire uses
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    left, right = SocketWire(None, 0, 2), SocketWire(None, 1, 2)
    left._add(1, a)  # what open() does once the connection is made and checked
    right._add(0, b)
    return left, right, a, b


def _failed(exc: BaseException) -> None:
    raise AssertionError(f"a post failed: {exc}")


def test_messages_arrive_whole_and_in_order_whatever_their_sizes():
    left, right, *_ = _pair()
    # bodies from none to more than a receive call takes (64 KiB), back to back
    sizes = [0, 1, 7, 512, 65_536 - fmt.HEADER_BYTES, 65_536, 200_000, 3, 0, 1 << 20, 9]
    bodies = [bytes((i * 31 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    got: list[tuple[list[int], bytes]] = []

    def listen() -> None:
        for _ in sizes:
            words = right.receive_header(0)
            n = words[fmt.H_BODY]
            got.append((words, bytes(right.receive_body(0, n)) if n else b""))

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    for i, body in enumerate(bodies):
        head = fmt.header_bytes(fmt.REPLY, 0, req=i, body_bytes=len(body))
        left.post(1, head, body or None, _failed)
    listener.join(30)
    assert not listener.is_alive()
    assert [w[fmt.H_REQ] for w, _ in got] == list(range(len(sizes)))
    assert [b for _, b in got] == bodies
    left.shutdown()
    right.shutdown()


def test_a_message_cut_across_receive_calls_is_put_back_together():
    left, right, a, _ = _pair()
    body = bytes(range(200))
    message = fmt.header_bytes(fmt.PULL, 0, req=5, ticket=9, body_bytes=len(body)) + body
    result: dict[str, object] = {}

    def listen() -> None:
        words = right.receive_header(0)
        result["words"] = words
        result["body"] = bytes(right.receive_body(0, words[fmt.H_BODY]))

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    cuts = (0, 10, 90, 150, len(message))  # inside the header twice, then inside the body
    for start, end in zip(cuts, cuts[1:]):
        a.sendall(message[start:end])
        time.sleep(0.02)  # so the listener's receive calls see each piece alone
    listener.join(10)
    assert not listener.is_alive()
    words = result["words"]
    assert isinstance(words, list) and words[fmt.H_REQ] == 5 and words[fmt.H_TICKET] == 9
    assert result["body"] == body
    left.shutdown()
    right.shutdown()


def test_a_connection_closed_mid_message_ends_the_receive_with_wire_closed():
    left, right, a, _ = _pair()
    a.sendall(fmt.header_bytes(fmt.BYE, 0)[:40])  # part of a header, then the peer is gone
    a.shutdown(socket.SHUT_RDWR)
    with pytest.raises(WireClosed, match="stage 0 closed its connection"):
        right.receive_header(0)
    left.shutdown()
    right.shutdown()
