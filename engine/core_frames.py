"""The engine-core socket's frames: a 4-byte big-endian length, then a pickle (a socketpair
that only the front door holds the other end of: pickle trusts its peer).

``frame_reader`` is the one reader of the format. It asks for byte counts and is sent the
bytes, so the core's blocking socket (``receive_frame``) and the front door's asyncio stream
(actors/engine_client.py) drive the same code."""

import pickle
import socket
import struct
from collections.abc import Generator
from typing import Any

FRAME_HEADER = struct.Struct("!I")


def encode_frame(message) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(data)) + data


def frame_reader() -> Generator[int, bytes, Any]:
    """Yields how many bytes it needs next; ``send`` it exactly those; returns the message."""
    (length,) = FRAME_HEADER.unpack((yield FRAME_HEADER.size))
    return pickle.loads((yield length))


def receive_frame(sock: socket.socket):
    """The next message from a blocking socket; EOFError when the peer closed its end."""
    reads = frame_reader()
    size = next(reads)
    try:
        while True:
            size = reads.send(_receive_exactly(sock, size))
    except StopIteration as done:
        return done.value


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer closed the engine core's socket")
        got += n
    return bytes(buffer)
