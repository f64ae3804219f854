"""Length-prefixed msgpack frames: a 4-byte big-endian length, then one msgpack map."""

from __future__ import annotations

import struct
from collections.abc import Callable

import msgpack

from protocol.messages import ProtocolError, validate

HEADER = struct.Struct(">I")
# A 10 MiB request body plus its headers fits; anything bigger is refused unread.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# Before its hello is welcomed a session may send a hello and no more: a token of some
# 300 bytes and metadata of a few hundred fit many times over. A session that may not
# yet be trusted is refused any larger frame as soon as its length arrives.
HELLO_FRAME_BYTES = 64 * 1024


class FrameError(ProtocolError):
    """The byte stream is not a sequence of valid frames; the session must end."""


def encode_frame(message: dict, pack: Callable[[dict], bytes] | None = None) -> bytes:
    """`pack`: a kept `msgpack.Packer(use_bin_type=True).pack`, cheaper than packb's."""
    payload = pack(message) if pack is not None else msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole validated messages."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        # Raised by the owner once the peer is trusted with larger frames.
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes) -> list[dict]:
        held = self._buf
        # With nothing held back, as for most reads (whole frames, a heartbeat's one),
        # the frames are decoded from `data` itself and only a partial frame at its end
        # is kept: no copy into the buffer and out again.
        buf: bytes | bytearray = data
        if held:
            held += data
            buf = held
        out: list[dict] = []
        size = len(buf)
        pos = 0
        while size - pos >= HEADER.size:
            (length,) = HEADER.unpack_from(buf, pos)
            if length > self.max_frame_bytes:
                raise FrameError(f"oversized frame: {length} bytes > limit {self.max_frame_bytes}")
            end = pos + HEADER.size + length
            if size < end:
                break
            out.append(decode_payload(bytes(buf[pos + HEADER.size : end])))
            pos = end
        if buf is held:
            del held[:pos]
        elif pos < size:
            held += data[pos:]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


def decode_payload(payload: bytes) -> dict:
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise FrameError(f"malformed frame: {type(exc).__name__}: {exc}") from None
    validate(message)
    return message
