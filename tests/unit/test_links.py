"""The links between the nodes of a multi-node engine and its authenticated stream channel
(``asyncpp.engines.vllm.links``), on real sockets on 127.0.0.1: what a lost link reports, that
strangers are neither read nor counted, and that a worker sees its driver go."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from asyncpp.engines.vllm import links


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.02)
    return pred()


@pytest.fixture
def server():
    lost: list[tuple[int, str]] = []
    secret = links.new_secret()
    srv = links.LinkServer("127.0.0.1", secret, lambda rank, peer: lost.append((rank, peer)))
    yield srv, secret, lost
    srv.stop()


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)))


def test_a_lost_link_names_its_worker_rank_and_peer(server):
    srv, secret, lost = server
    worker = links.hold_link(srv.address, secret, 3, None)
    time.sleep(0.2)
    assert lost == []
    worker.shutdown(socket.SHUT_RDWR)  # as the worker's process ending closes it
    worker.close()
    assert wait_for(lambda: lost)
    rank, peer = lost[0]
    assert rank == 3 and peer.startswith("127.0.0.1:")


def test_strangers_do_not_count(server):
    srv, secret, lost = server
    wrong = connect(srv.address)
    wrong.sendall(b"0" * (len(secret) + 8))  # the wrong secret
    silent = connect(srv.address)  # says nothing
    assert wait_for(lambda: wrong.recv(1) == b"")  # closed by the server, unread
    silent.close()
    wrong.close()
    time.sleep(0.3)
    assert lost == []
    worker = links.hold_link(srv.address, secret, 1, None)  # the real worker still gets in
    time.sleep(0.2)
    worker.shutdown(socket.SHUT_RDWR)
    worker.close()
    assert wait_for(lambda: lost) and lost[0][0] == 1


def test_only_the_first_lost_link_is_reported(server):
    srv, secret, lost = server
    workers = [links.hold_link(srv.address, secret, r, None) for r in range(3)]
    time.sleep(0.2)
    for w in workers:
        w.shutdown(socket.SHUT_RDWR)
        w.close()
    assert wait_for(lambda: lost)
    time.sleep(0.3)
    assert len(lost) == 1


def test_a_worker_sees_its_driver_go_and_a_stopped_server_reports_nothing(server):
    srv, secret, lost = server
    gone = threading.Event()
    worker = links.hold_link(srv.address, secret, 0, gone.set)
    time.sleep(0.2)
    srv.stop()  # the engine closing: the links end without a report
    assert gone.wait(5)
    assert lost == []
    worker.close()


def test_the_stream_socket_reads_only_authenticated_senders():
    import zmq

    secret = links.new_secret()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    auth = links.serve_securely(ctx, pull, secret)
    try:
        port = pull.bind_to_random_port(links.tcp_endpoint("127.0.0.1"))
        address = f"tcp://127.0.0.1:{port}"
        stranger = ctx.socket(zmq.PUSH)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(address)  # no credentials
        stranger.send(b"unpickle me", zmq.NOBLOCK)
        imposter = ctx.socket(zmq.PUSH)
        imposter.setsockopt(zmq.LINGER, 0)
        links.connect_securely(imposter, address, links.new_secret())  # the wrong secret
        imposter.send(b"me too", zmq.NOBLOCK)
        assert pull.poll(1000) == 0
        sender = ctx.socket(zmq.PUSH)
        sender.setsockopt(zmq.LINGER, 0)
        links.connect_securely(sender, address, secret)
        sender.send(b"hello")
        assert pull.poll(5000) and pull.recv() == b"hello"
        assert pull.poll(300) == 0  # nothing else ever came through
        for s in (stranger, imposter, sender):
            s.close()
    finally:
        pull.close()
        auth.stop()
        ctx.term()
