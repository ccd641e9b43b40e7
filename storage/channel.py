"""A Unix-socket channel between a store client and a shard on the same node.

The shard listens on an abstract socket address (`\\0ppoflow-...`: no file to clean up, gone when
the shard's process is) and accepts only peers of its own user. A connection opens with a hello
that passes the client's shared-memory arena (`storage.shm`) as a file descriptor and proves the
two processes really share it; after that each request and reply is one frame, an 8-byte
little-endian length and a UTF-8 JSON header, while column bytes stay in the arena. A connection
carries one request at a time: the client waits for the reply before it writes the arena again.

The client side (`Connection`) is blocking with deadlines; the server side (`serve`) is a thread
per connection in the shard's process, calling the shard's thread-safe handler. A round trip
costs tens of microseconds where a Ray actor call costs about a millisecond.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from storage.shm import Arena

_LENGTH = struct.Struct("<Q")
_MAX_FRAME = 1 << 31  # a header this large means a broken peer
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_RECV = 1 << 16

Header = dict[str, Any]
Handler = Callable[[Header, Arena], Header]


class ChannelClosed(ConnectionError):
    """The peer closed the connection or broke the protocol."""


def new_address() -> str:
    """A fresh abstract socket name (without its leading NUL)."""
    return f"ppoflow-{secrets.token_hex(12)}"


def _frame(header: Mapping[str, Any]) -> bytes:
    body = json.dumps(header).encode()
    return _LENGTH.pack(len(body)) + body


def _parse(buffer: bytearray) -> Header | None:
    """Takes one complete frame off the front of `buffer`, if there is one."""
    if len(buffer) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(buffer)
    if length > _MAX_FRAME:
        raise ChannelClosed(f"frame of {length} bytes")
    end = _LENGTH.size + length
    if len(buffer) < end:
        return None
    header = json.loads(bytes(buffer[_LENGTH.size : end]))
    del buffer[:end]
    if not isinstance(header, dict):
        raise ChannelClosed("a frame that is not a JSON object")
    return header


# -- the client side ---------------------------------------------------------------------------


class Connection:
    """A blocking connection from a client to one shard, with its own arena."""

    def __init__(self, address: str, timeout: float) -> None:
        """Connects and shakes hands; OSError or ChannelClosed if the shard cannot be reached."""
        self._buffer = bytearray()
        self.arena = Arena.create()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect("\0" + address)
            token = self.arena.probe(secrets.token_bytes(16))
            socket.send_fds(self._sock, [_frame({"op": "hello"})], [self.arena.fd])
            reply = self.receive(time.monotonic() + timeout)
            if reply.get("probe") != token.hex():
                raise ChannelClosed("the shard does not see this process's shared memory")
        except BaseException:
            self.close()
            raise

    def send(self, header: Mapping[str, Any]) -> None:
        self._sock.sendall(_frame(header))

    def receive(self, deadline: float) -> Header:
        """The next reply; TimeoutError when `deadline` (time.monotonic) passes first."""
        while True:
            header = _parse(self._buffer)
            if header is not None:
                return header
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no reply before the deadline")
            self._sock.settimeout(remaining)
            chunk = self._sock.recv(_RECV)
            if not chunk:
                raise ChannelClosed("the shard closed the connection")
            self._buffer += chunk

    def close(self) -> None:
        self._sock.close()
        self.arena.close()


# -- the server side ---------------------------------------------------------------------------


class Server:
    """A listening socket served by threads: one accepts, one serves each connection.

    Each connection's thread blocks in `recv` and calls `handle(request, arena)` itself, so a
    request costs two thread wake-ups and no event-loop turns (an actor's asyncio loop costs
    more per frame).
    `handle` must be thread-safe: connections are served at once, and it may block (a get
    waiting for a put), which holds only its connection.
    """

    def __init__(self, address: str, handle: Handler) -> None:
        self.address = address
        self._handle = handle
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + address)
        self._listener.listen(128)
        self._acceptor = threading.Thread(
            target=self._accept, name=f"{address}-accept", daemon=True
        )
        self._acceptor.start()

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        """Stops listening and drops every connection (their threads end on their own)."""
        with self._lock:
            self._closed = True
            connections = list(self._open)
        with contextlib.suppress(OSError):  # wakes the accepting thread on Linux
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)  # e.g. out of descriptors for a moment: keep listening
                continue
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            if _PEERCRED.unpack(cred)[1] != os.getuid():
                conn.close()  # another user's process: the store is not theirs to read
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._open.add(conn)
            name = f"{self.address}-conn"
            threading.Thread(target=self._serve, args=(conn,), name=name, daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = bytearray()
        fds: list[int] = []
        arena: Arena | None = None
        try:
            while True:
                header = _next_frame(conn, buffer, fds)
                if header is None:
                    return
                if arena is None:  # the first frame is the hello, with the arena
                    if header.get("op") != "hello" or len(fds) != 1:
                        return
                    arena = Arena(fds.pop())
                    reply = {"probe": arena.probe().hex()}
                else:
                    reply = self._handle(header, arena)
                conn.sendall(_frame(reply))
        except (OSError, ChannelClosed, ValueError):
            return  # the client went away or spoke nonsense: drop the connection
        finally:
            with self._lock:
                self._open.discard(conn)
            for fd in fds:
                os.close(fd)
            if arena is not None:
                arena.close()
            conn.close()


def _next_frame(conn: socket.socket, buffer: bytearray, fds: list[int]) -> Header | None:
    """The next frame of a connection (descriptors that came with it go to `fds`); None at EOF."""
    while True:
        header = _parse(buffer)
        if header is not None:
            return header
        data, received, _, _ = socket.recv_fds(conn, _RECV, 1)
        fds += received
        if not data:
            return None
        buffer += data


def serve(address: str, handle: Handler) -> Server:
    """Starts serving `address` on threads of this process; `handle(request, arena)` answers."""
    return Server(address, handle)
