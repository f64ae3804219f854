"""The HTTP port of a `serve --workers N` host: one listening socket per worker, bound
and held by the supervisor, and a steering program that sends new connections only to
workers that serve.

Why the supervisor holds them: a listening socket that closes resets every connection
the kernel completed for it that nobody had accepted yet. When each worker bound its own
SO_REUSEPORT socket, a rolled worker's close raced the kernel: a connection completed
between its last accept and its close was reset before any answer (CI saw three in one
rolling restart under load). Held by the supervisor, a worker's socket outlives the
worker: the worker's close drops only its own reference, and what the kernel still
queues there waits for the successor, which inherits the same socket.

Why steer: the kernel spreads new connections over the sockets of the group by a hash
of the addresses, whether or not the socket's worker serves, so a worker being replaced
would collect a share of the new clients for as long as its successor takes to start. A
classic BPF program attached to the group (SO_ATTACH_REUSEPORT_CBPF, Linux 4.5) picks
the socket instead: a random one of the serving workers', or, when none serves yet, an
index past the end, on which the kernel falls back to its hash. The index of a socket is
the order it joined the group, the order bound here: stable, because the supervisor
closes none of them while it runs.
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Sequence

# <asm-generic/socket.h>; Python's socket module does not name it.
SO_ATTACH_REUSEPORT_CBPF = 51
# Classic BPF opcodes (<linux/filter.h>) and the ancillary load of a random number.
_LD_W_ABS = 0x20
_ALU_MOD_K = 0x94
_JEQ_K = 0x15
_RET_K = 0x06
_RANDOM = 0xFFFFF000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM
# Out of the group's range: the kernel picks by its hash, as with no program.
KERNEL_HASH = 0xFFFFFFFF


class _Instruction(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Instruction))]


def bind_shared(addr: tuple[str, int], count: int) -> list[socket.socket]:
    """`count` listening sockets on `addr`, sharing it (SO_REUSEPORT). Port 0: the
    first socket's port for all."""
    host, port = addr
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(sockaddr)
            sockaddr = sock.getsockname()
            sock.listen(0xFFFF)  # trio's own default backlog: the kernel's somaxconn
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def steering_program(serving: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """The instructions (code, jt, jf, k): a random index among `serving`'s, or
    KERNEL_HASH when it is empty."""
    if not serving:
        return [(_RET_K, 0, 0, KERNEL_HASH)]
    program = [(_LD_W_ABS, 0, 0, _RANDOM), (_ALU_MOD_K, 0, 0, len(serving))]
    for position, index in enumerate(serving):
        program += [(_JEQ_K, 0, 1, position), (_RET_K, 0, 0, index)]
    program.append((_RET_K, 0, 0, KERNEL_HASH))
    return program


def steer(sock: socket.socket, serving: Sequence[int]) -> None:
    """Attach the program for `serving` to the group of `sock` (any of its sockets),
    replacing the one before. OSError where the kernel refuses it."""
    instructions = steering_program(serving)
    table = (_Instruction * len(instructions))(*(_Instruction(*i) for i in instructions))
    program = _Program(len(instructions), table)
    # The option takes a struct sock_fprog, whose second field points at the table:
    # `table` stays alive through the call.
    raw = ctypes.string_at(ctypes.addressof(program), ctypes.sizeof(program))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, raw)
