"""NVIDIA's PersonaPlex WebSocket protocol (`GET /api/chat`), as its web client speaks it.

Every binary message starts with a kind byte:

    0x00 handshake  server -> client, once the caller's persona is primed (just the byte)
    0x01 audio      both ways: whole Ogg pages of Opus, mono, 24 kHz
    0x02 text       server -> client: one SentencePiece piece, UTF-8, `▁` as a space
    0x03 control    client -> server in NVIDIA's client code: accepted, ignored
    0x04 metadata   JSON; server -> client only when the caller asked (`stats=1`)
    0x05 error      server -> client: why the connection is being closed, UTF-8
    0x06 ping       client -> server: accepted, ignored

Anything else a client sends is a bad message: it gets a 0x05 message and its connection is
closed (only its own), with the close code below.
"""

from __future__ import annotations

import json

DEFAULT_PORT = 8998  # NVIDIA's server listens here; serve's --port and doctor's check use it

HANDSHAKE = 0x00
AUDIO = 0x01
TEXT = 0x02
CONTROL = 0x03
METADATA = 0x04
ERROR = 0x05
PING = 0x06

# Kinds a client may send that mean nothing to the server.
IGNORED_FROM_CLIENT = (CONTROL, METADATA, PING)

# Every WebSocket route's limit on a client's message. A browser page of 40 ms of Opus is
# about 100-300 bytes; a client bundling a second of pages stays far below this, and so
# does a Realtime append of a second of PCM16 (64000 bytes of base64 in its JSON).
MAX_MESSAGE_BYTES = 64 * 1024
# The WebSocket layer drops a connection outright above this (no word to the client then);
# between the two, the route says why before it closes. Permessage-deflate is refused
# (serve/runner.py), so this is also what a message costs to receive: a compressed one
# could inflate a thousandfold.
TRANSPORT_MAX_MESSAGE_BYTES = 2 * MAX_MESSAGE_BYTES

OGG_MAGIC = b"OggS"

# WebSocket close codes (RFC 6455 section 7.4.1, and 1013 from the IANA registry).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server shuts down
CLOSE_UNSUPPORTED = 1003  # a kind the server does not take (text, an unknown kind byte)
CLOSE_BAD_DATA = 1007  # audio that is not Ogg Opus, or corrupt
CLOSE_POLICY = 1008  # no token, a bad query, a refused persona
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN = 1013  # every slot is taken, or too many connections from one address


class BadMessage(Exception):
    """A message the protocol does not allow: `str(error)` is the 0x05 text."""

    def __init__(self, message: str, close_code: int):
        super().__init__(message)
        self.close_code = close_code


def handshake() -> bytes:
    return bytes([HANDSHAKE])


def audio(pages: bytes) -> bytes:
    return bytes([AUDIO]) + pages


def text(piece: str) -> bytes:
    return bytes([TEXT]) + piece.encode("utf-8")


def error(message: str) -> bytes:
    return bytes([ERROR]) + message.encode("utf-8")


def metadata(value: dict) -> bytes:
    return bytes([METADATA]) + json.dumps(value).encode("utf-8")


def check_size(message: bytes | str) -> None:
    """Raises BadMessage (1009) for a message over MAX_MESSAGE_BYTES."""
    size = len(message) if isinstance(message, bytes) or message.isascii() else \
        len(message.encode("utf-8", "surrogatepass"))
    if size > MAX_MESSAGE_BYTES:
        raise BadMessage(f"a message of {size} bytes is over the limit of "
                         f"{MAX_MESSAGE_BYTES}", CLOSE_TOO_BIG)


def client_audio(message: bytes | str) -> bytes | None:
    """A client's message -> its Ogg pages, or None for a kind that is ignored; raises
    BadMessage for anything the protocol does not allow."""
    if isinstance(message, str):
        raise BadMessage("text messages are not part of the protocol: send binary ones",
                         CLOSE_UNSUPPORTED)
    if not message:
        raise BadMessage("an empty message has no kind byte", CLOSE_UNSUPPORTED)
    check_size(message)
    kind = message[0]
    if kind == AUDIO:
        pages = message[1:]
        if not pages.startswith(OGG_MAGIC):
            raise BadMessage("audio messages hold whole Ogg pages (they start with OggS)",
                             CLOSE_BAD_DATA)
        return pages
    if kind in IGNORED_FROM_CLIENT:
        return None
    if kind == TEXT:
        raise BadMessage("the server takes no text from the client, only audio",
                         CLOSE_UNSUPPORTED)
    if kind in (HANDSHAKE, ERROR):
        raise BadMessage(f"kind 0x{kind:02x} goes from the server to the client only",
                         CLOSE_UNSUPPORTED)
    raise BadMessage(f"unknown message kind 0x{kind:02x}", CLOSE_UNSUPPORTED)
