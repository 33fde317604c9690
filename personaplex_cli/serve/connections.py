"""Connections before they are requests, and after they stop listening: what uvicorn's own
protocols leave to the application, on its HTTP (httptools) and WebSocket (sans-I/O) classes.

- A request's head must arrive within HEAD_TIMEOUT_S of the connection (or of the previous
  response on a kept-alive one): a socket that sends nothing, or a byte now and then, is
  closed then (uvicorn's keep-alive timer restarts on every byte).
- Open connections are capped (`Limits.most`, below the descriptors the process may
  open). One over the cap closes the oldest connection still waiting for its head, so a
  thousand idle sockets cannot keep a caller out; when none is waiting, the newcomer gets
  503 and is closed.
- A WebSocket whose closing handshake the client never completes (it does not read) is
  cut CLOSE_GRACE_S later, as is one that misses a ping: asyncio's close() would wait for
  its unread buffer forever. A call on a socket cut for its ping hears why, for its log
  line: the cut marks the scope (CUT_KEY), and the transport raises call.Cut from the
  receive that meets the disconnect or the send that meets the closed socket, whichever
  comes first.
- An HTTP response that its client stops reading (a stream, a long answer) is cut once its
  writing has waited `Limits.stalled_s` (serve's --idle-timeout) without the client taking
  a byte: it holds no buffer, and no slot, for good. What the kernel holds for a client
  that does not read is bounded too (SEND_BUFFER_BYTES; Linux's own tuning lets a
  connection's buffer grow to 4 MB, which would hide a stalled reader from the server for
  that long): at 100 ms round trip it still carries 2.6 MB/s, forty times a Realtime
  call's audio.
- The soft limit on open files is raised to the hard one at start; errors the event loop
  reports (EMFILE from accept, when it happens all the same) are one line a second at most.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field

HEAD_TIMEOUT_S = 10.0
CLOSE_GRACE_S = 2.0
MOST_CONNECTIONS = 4096
# Connections the event loop accepts in one go before any of them is looked at (the listen
# backlog, which asyncio also takes as its accept batch): the cap must leave room for them.
BACKLOG = 128
SPARE_DESCRIPTORS = 64 + BACKLOG  # and for model files, temporary uploads, threads, the log
REPORT_EVERY_S = 1.0
SEND_BUFFER_BYTES = 128 * 1024  # the kernel doubles it

# The request line the WebSocket layer parses again holds the whole query (query.py's
# MAX_QUERY_BYTES) and the path; websockets cuts it at 8 KiB by default.
REQUEST_LINE_BYTES = 16 * 1024


def _busy() -> bytes:
    text = b"too many open connections: try again later\n"
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))


def raise_descriptor_limit() -> int:
    """Raises the soft limit on open files to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a kernel cap below the hard limit: keep what we have
            pass
    return soft


def open_descriptors() -> int:
    import os

    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


# Why the server cut a WebSocket (the queued disconnect's reason and call.Cut's words).
CUT_REASON = "missed a ping: it does not read"
# The scope key set on a WebSocket the server cut: the transport's one sign of it (a send
# after the cut fails in uvicorn with a plain RuntimeError).
CUT_KEY = "personaplex.cut"


@dataclass
class Limits:
    """The cap on open connections, those still waiting for a request's head (oldest
    first), and how long a response may wait for its client to read."""

    most: int
    waiting: dict = field(default_factory=dict)
    stalled_s: float = 60.0

    @classmethod
    def for_process(cls, stalled_s: float = 60.0) -> Limits:
        soft = raise_descriptor_limit()
        room = soft - open_descriptors() - SPARE_DESCRIPTORS
        return cls(max(1, min(MOST_CONNECTIONS, room)), stalled_s=stalled_s)


class OnceASecond:
    """One line a second at most to stderr, with how many were held back meanwhile."""

    def __init__(self, write=None):
        self._write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self._last = -REPORT_EVERY_S
        self._held = 0

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if now - self._last < REPORT_EVERY_S:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        self._write(line + (f" ({held} more like it in the last second)" if held else ""))


def loop_error_handler(report: OnceASecond):
    """An asyncio exception handler that writes one line, not a traceback, once a second."""

    def handle(loop, context) -> None:
        error = context.get("exception")
        what = context.get("message", "event loop error")
        if error is not None:
            what = f"{what}: {type(error).__name__}: {error}"
        report(" ".join(what.split()))

    return handle


def reset(transport) -> None:
    """Closes a connection at once, with a reset: a plain close would queue its FIN after
    the data the client does not read, and the kernel would hold both for minutes."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        import socket
        import struct

        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:  # closed already
            pass
    transport.abort()


def _http_protocol():
    """uvicorn's httptools protocol where httptools is installed, else its h11 one."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as protocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as protocol
    return protocol


def protocols(limits: Limits):
    """uvicorn's HTTP and WebSocket protocol classes, with the limits above."""
    import websockets.http11
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    # websockets reads this module global at each parse.
    websockets.http11.MAX_LINE_LENGTH = max(websockets.http11.MAX_LINE_LENGTH,
                                            REQUEST_LINE_BYTES)

    class GuardedHTTP(_http_protocol()):
        _head_timer = None
        _stall_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                import socket

                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            if len(self.connections) > limits.most and not self._evict_one():
                self.connections.discard(self)
                transport.write(_busy())
                transport.close()
                return
            self._await_head()

        def _evict_one(self) -> bool:
            for oldest in limits.waiting:
                oldest._head_timed_out()
                return True
            return False

        def _await_head(self) -> None:
            self._stop_waiting()
            limits.waiting[self] = None
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

        def _stop_waiting(self) -> None:
            limits.waiting.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._stop_waiting()
            self.connections.discard(self)
            self.transport.abort()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._stop_waiting()  # a whole head came: a request is being answered

        def handle_websocket_upgrade(self, *args) -> None:
            self._stop_waiting()
            super().handle_websocket_upgrade(*args)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_head()  # the next request's head, on a kept-alive connection

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(limits.stalled_s, reset,
                                                         self.transport)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop_stall()

        def _stop_stall(self) -> None:
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def connection_lost(self, exc) -> None:
            self._stop_waiting()
            self._stop_stall()
            super().connection_lost(exc)

    class GuardedWebSocket(WebSocketsSansIOProtocol):
        def _cut_later(self) -> None:
            self.loop.call_later(CLOSE_GRACE_S, self._cut)

        def _cut(self) -> None:
            if not self.disconnected:
                reset(self.transport)

        def keepalive_timeout(self) -> None:
            if not self.close_sent and not self.transport.is_closing():
                self.scope[CUT_KEY] = True
                self.queue.put_nowait({"type": "websocket.disconnect", "code": 1011,
                                       "reason": CUT_REASON})
            super().keepalive_timeout()
            self._cut()  # it does not read: the close frame would never leave

        async def run_asgi(self) -> None:
            await super().run_asgi()
            self._cut_later()

    return GuardedHTTP, GuardedWebSocket
