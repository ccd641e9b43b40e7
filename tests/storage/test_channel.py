"""The local socket channel: hello with the arena, framed requests, deadlines, closed peers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from storage import shm
from storage.channel import ChannelClosed, Connection, Header, Server, new_address, serve
from storage.shm import Arena

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd and Unix sockets")


_GATE = threading.Event()


def _handle(request: Header, arena: Arena) -> Header:
    """Sums the arrays a request put in the arena, after an optional nap."""
    if request.get("gate"):  # blocks until the test opens the gate (or 10 s pass)
        return {"sum": 0, "echo": request["echo"], "opened": _GATE.wait(10)}
    time.sleep(request.get("nap", 0))
    arena.follow(request["arena"])
    total = sum(int(array.sum()) for array in arena.read(request["arrays"]))
    return {"sum": total, "echo": request["echo"]}


@pytest.fixture
def server() -> Iterator[Server]:
    """A server on threads of this process, like a shard's."""
    server = serve(new_address(), _handle)
    yield server
    server.close()


def _request(conn: Connection, arrays: list[np.ndarray], **header: object) -> Header:
    layout = conn.arena.write(arrays)
    conn.send({**header, "arrays": layout, "arena": conn.arena.size})
    return conn.receive(time.monotonic() + 10)


def _wait_for(check: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert check(), "the server did not catch up"


def test_requests_and_replies_go_through_one_connection(server: Server) -> None:
    conn = Connection(server.address, timeout=10)
    for n in (10, 300_000):  # the second grows the arena past its first size
        reply = _request(conn, [np.ones(n, np.int64), np.arange(3)], echo="é" * 3)
        assert reply == {"sum": n + 3, "echo": "ééé"}
    assert server.connections == 1
    conn.close()
    _wait_for(lambda: server.connections == 0)


def test_a_reply_later_than_the_deadline_raises_timeout(server: Server) -> None:
    conn = Connection(server.address, timeout=10)
    conn.send({"nap": 0.5, "echo": 1, "arrays": [], "arena": conn.arena.size})
    with pytest.raises(TimeoutError):
        conn.receive(time.monotonic() + 0.05)
    conn.close()  # a late reply would be read as the next one: the connection is dropped
    _wait_for(lambda: server.connections == 0)


def test_a_hello_without_an_arena_is_hung_up_on(server: Server) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + server.address)
    sock.sendall(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    assert sock.recv(16) == b""  # closed without an answer
    sock.close()


def test_a_missing_server_cannot_be_reached() -> None:
    with pytest.raises(OSError):
        Connection(new_address(), timeout=1)


def test_a_client_that_stops_sending_is_hung_up_on(server: Server) -> None:
    conn = Connection(server.address, timeout=10)
    conn._sock.shutdown(socket.SHUT_WR)  # the server sees EOF and closes its end
    with pytest.raises(ChannelClosed):
        conn.receive(time.monotonic() + 10)
    conn.close()


def test_connections_are_served_at_once(server: Server) -> None:
    """A request that blocks its handler holds only its own connection."""
    _GATE.clear()
    slow, fast = Connection(server.address, timeout=10), Connection(server.address, timeout=10)
    slow.send({"gate": True, "echo": "slow", "arrays": [], "arena": slow.arena.size})
    assert _request(fast, [np.arange(4)], echo="fast") == {"sum": 6, "echo": "fast"}
    _GATE.set()  # only now may the slow handler answer: served one by one, it would time out
    assert slow.receive(time.monotonic() + 30) == {"sum": 0, "echo": "slow", "opened": True}
    slow.close()
    fast.close()


def test_close_drops_open_connections_and_stops_listening() -> None:
    server = serve(new_address(), _handle)
    conn = Connection(server.address, timeout=10)
    server.close()
    with pytest.raises(ChannelClosed):
        conn.receive(time.monotonic() + 10)
    conn.close()
    with pytest.raises(OSError):
        Connection(server.address, timeout=1)
    _wait_for(lambda: server.connections == 0)
