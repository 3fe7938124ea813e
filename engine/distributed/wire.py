"""How commands travel: length-prefixed pickles over the daemon's local socket, and from rank 0
to every rank through `mx.distributed` itself (no transport of our own between ranks).

Pickle is safe here: both ends are this program, started by the daemon on machines it was
told to use, and the socket is a file only the daemon's user can open.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

import mlx.core as mx
import numpy as np

_HEAD = struct.Struct("!Q")


class PeerGone(ConnectionError):
    """The other end of the socket closed."""


def send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEAD.pack(len(data)) + data)


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise PeerGone("the connection closed")
        buf += chunk
    return bytes(buf)


def receive(sock: socket.socket) -> Any:
    (n,) = _HEAD.unpack(_read(sock, _HEAD.size))
    return pickle.loads(_read(sock, n))


def broadcast(data: bytes | None, group: mx.distributed.Group) -> bytes:
    """Rank 0's bytes on every rank: a sum where only rank 0 contributes (the length first)."""
    mine = data if group.rank() == 0 and data is not None else b""
    n = mx.distributed.all_sum(mx.array([len(mine)], dtype=mx.int32), group=group)
    size = int(np.array(n)[0])
    if group.rank() == 0:
        buf = mx.array(np.frombuffer(mine, dtype=np.uint8))
    else:
        buf = mx.zeros((size,), dtype=mx.uint8)
    total = mx.distributed.all_sum(buf, group=group)
    mx.eval(total)
    return bytes(np.array(total, copy=False))


def gather_text(text: str, group: mx.distributed.Group, width: int = 256) -> list[str]:
    """Every rank's `text` (up to `width` bytes) on every rank, in rank order."""
    raw = text.encode()[:width]
    slots = np.zeros((group.size(), width), dtype=np.uint8)
    slots[group.rank(), : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    total = np.array(mx.distributed.all_sum(mx.array(slots), group=group))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in total]
