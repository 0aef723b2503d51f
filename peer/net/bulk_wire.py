"""The bulk lane's wire format: a request head, the Envelope's serialized bytes, a reply.

Why a lane beside gRPC: gRPC's Python API takes and gives each message as a ``bytes`` object, so a tensor byte is
copied into one on the sender and out of one on the receiver, on top of gRPC's own copies (about a quarter of a
push's CPU on loopback, see docs/benchmarks/transport.md). On a plain (or TLS) socket the sender hands the
kernel the tensor's own memory and the receiver reads into a buffer it reuses, so large pushes travel at the
speed of the socket. Only pushes use it; every check of the gRPC path is the same code (peer.net.server).

One connection carries one request at a time (a client keeps a few open, see peer.net.bulk_client):

    client -> server   HEAD: magic "TKB1", protocol version u32, deadline in ms u32, total bytes u64
                       then exactly `total` bytes: the serialized Envelope (as a gRPC push's chunks carry it)
    server -> client   REPLY: magic "TKR1", status code u32 (gRPC's numbering), bytes received u64,
                       message length u16, then the message (UTF-8, at most MAX_REPLY_MESSAGE bytes)

Little-endian, fixed sizes: a hostile head costs the server HEAD.size bytes and one check. A refusal ends the
connection after its reply; a success leaves it open for the next request.
"""

from __future__ import annotations

import socket
import struct

import grpc

HEAD = struct.Struct("<4sIIQ")
REPLY = struct.Struct("<4sIQH")
HEAD_MAGIC = b"TKB1"
REPLY_MAGIC = b"TKR1"
MAX_REPLY_MESSAGE = 1000

CODE_OF = {code.value[0]: code for code in grpc.StatusCode}


class LaneClosedError(ConnectionError):
    """The other side closed the connection (or sent something that is not the lane's)."""


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (socket timeouts apply); LaneClosedError when the stream ends first."""
    got, n = 0, view.nbytes
    while got < n:
        read = sock.recv_into(view[got:], n - got)
        if not read:
            raise LaneClosedError(f"connection closed after {got} of {n} bytes")
        got += read


def encode_reply(code: grpc.StatusCode, received: int, message: str = "") -> bytes:
    text = message.encode("utf-8", "replace")[:MAX_REPLY_MESSAGE]
    return REPLY.pack(REPLY_MAGIC, code.value[0], received, len(text)) + text


def read_reply(sock: socket.socket, start: bytes = b"") -> tuple[grpc.StatusCode, int, str]:
    """(code, bytes received, message) of a reply whose first bytes (``start``) may have been read already;
    LaneClosedError for anything that is not one."""
    head = bytearray(REPLY.size)
    head[: len(start)] = start
    recv_exact(sock, memoryview(head)[len(start) :])
    magic, code, received, length = REPLY.unpack(head)
    if magic != REPLY_MAGIC or code not in CODE_OF or length > MAX_REPLY_MESSAGE:
        raise LaneClosedError("the peer's reply is not a bulk-lane reply")
    text = bytearray(length)
    recv_exact(sock, memoryview(text))
    return CODE_OF[code], received, text.decode("utf-8", "replace")
