"""A Unix-socket channel between a store client and a shard on the same node.

The shard listens on an abstract socket address (`\\0ppoflow-...`: no file to clean up, gone when
the shard's process is) and accepts only peers of its own user. A connection opens with a hello
that passes the client's shared-memory arena (`storage.shm`) as a file descriptor and proves the
two processes really share it; after that each request and reply is one frame, an 8-byte
little-endian length and a UTF-8 JSON header, while column bytes stay in the arena. A connection
carries one request at a time: the client waits for the reply before it writes the arena again.

The client side (`Connection`) is blocking with deadlines; the server side (`serve`) runs on the
shard's asyncio loop, next to its Ray methods, so both see the same state. A round trip costs
tens of microseconds where a Ray actor call costs about a millisecond.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from storage.shm import Arena

_LENGTH = struct.Struct("<Q")
_MAX_FRAME = 1 << 31  # a header this large means a broken peer
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_RECV = 1 << 16

Header = dict[str, Any]
Handler = Callable[[Header, Arena], Awaitable[Header]]


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
    """A listening socket on the running loop and the tasks serving its connections."""

    def __init__(self, address: str, handle: Handler) -> None:
        self.address = address
        self.connections = 0
        self._handle = handle
        self._tasks: set[asyncio.Task[None]] = set()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + address)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._spawn(self._accept())

    async def close(self) -> None:
        """Stops listening and drops every connection."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError:  # e.g. out of descriptors for a moment: keep listening
                await asyncio.sleep(0.1)
                continue
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            if _PEERCRED.unpack(cred)[1] != os.getuid():
                conn.close()  # another user's process: the store is not theirs to read
                continue
            conn.setblocking(False)
            self._spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        buffer = bytearray()
        fds: list[int] = []
        arena: Arena | None = None
        self.connections += 1
        try:
            while True:
                header = await _next_frame(loop, conn, buffer, fds)
                if header is None:
                    return
                if arena is None:  # the first frame is the hello, with the arena
                    if header.get("op") != "hello" or len(fds) != 1:
                        return
                    arena = Arena(fds.pop())
                    reply = {"probe": arena.probe().hex()}
                else:
                    reply = await self._handle(header, arena)
                await loop.sock_sendall(conn, _frame(reply))
        except (OSError, ChannelClosed, ValueError):
            return  # the client went away or spoke nonsense: drop the connection
        finally:
            self.connections -= 1
            for fd in fds:
                os.close(fd)
            if arena is not None:
                arena.close()
            conn.close()


async def _next_frame(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, buffer: bytearray, fds: list[int]
) -> Header | None:
    """The next frame of a connection (descriptors that came with it go to `fds`); None at EOF."""
    while True:
        header = _parse(buffer)
        if header is not None:
            return header
        try:
            data, received, _, _ = socket.recv_fds(conn, _RECV, 1)
        except BlockingIOError:
            await _readable(loop, conn)
            continue
        fds += received
        if not data:
            return None
        buffer += data


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def serve(address: str, handle: Handler) -> Server:
    """Starts serving `address` on the running loop; `handle(request, arena)` answers requests."""
    return Server(address, handle)
