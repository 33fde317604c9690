"""Serving: uvicorn on a socket bound once the model is warm, until a signal or a failure.

The port opens only after warm-up: the socket is bound then and handed to uvicorn. On
SIGINT or SIGTERM every session gets a 0x05 message and a close (1001) before the server
stops, which uvicorn's own signal handling would not do (it closes WebSockets with 1012 and
no word), so the runner handles the signals itself. A second signal stops at once: the
process exits there (128 + the signal's number), whatever is still closing.

Connections get the limits of serve/connections.py (head timeout, a cap, cut when they stop
reading); the WebSocket ping runs at half the idle timeout, so a client that stops reading
its socket misses a ping and is cut within `--idle-timeout`, and an HTTP response its client
stops reading is cut after `--idle-timeout`. WebSocket compression (permessage-deflate) is
refused: a message of protocol.MAX_MESSAGE_BYTES could otherwise inflate from a few hundred
bytes on the wire, and cost the server a thousand times what it cost its sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import Callable

from .connections import BACKLOG
from .protocol import TRANSPORT_MAX_MESSAGE_BYTES

MOST_PING_S = 20.0


def ping_seconds(idle_timeout: float) -> float:
    """The WebSocket ping's interval and timeout: a client that stops reading misses a ping
    and is cut between half the idle timeout and the whole of it after."""
    return min(MOST_PING_S, idle_timeout / 2)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (raises OSError: in use, no such address)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = info[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def serve(switchboard, app, sock: socket.socket, *, ssl_cert: str | None = None,
          ssl_key: str | None = None, on_ready: Callable[[Callable[[], None]], None] = lambda stop: None,
          handle_signals: bool = True) -> int | None:
    """Serves until a signal (-> its number), an engine failure (-> None, switchboard.failure) or
    the `stop` that `on_ready(stop)` gets is called (from any thread). Without
    `handle_signals` (a server in a thread) the signals are left alone."""
    import uvicorn

    from .connections import Limits, OnceASecond, loop_error_handler, protocols

    http, websocket = protocols(Limits.for_process(stalled_s=switchboard.idle_timeout))
    ping = ping_seconds(switchboard.idle_timeout)
    report = OnceASecond()

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # ours, below: sessions are told before the end
            yield

    config = uvicorn.Config(app, http=http, ws=websocket,
                            ws_max_size=TRANSPORT_MAX_MESSAGE_BYTES,
                            ws_per_message_deflate=False,
                            ws_ping_interval=ping, ws_ping_timeout=ping, backlog=BACKLOG,
                            lifespan="off", log_config=None, access_log=False,
                            log_level="warning", ssl_certfile=ssl_cert, ssl_keyfile=ssl_key,
                            timeout_graceful_shutdown=2)
    server = Server(config)
    previous = ({signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
                if handle_signals else {})
    caught: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(loop_error_handler(report))

        async def stop() -> None:
            await switchboard.shutdown()
            server.should_exit = True

        def on_signal(signum: int) -> None:
            if caught:  # the second one: leave now, whatever is still closing
                os._exit(128 + signum)
            caught.append(signum)
            loop.create_task(stop())

        for signum in previous:
            loop.add_signal_handler(signum, on_signal, signum)
        switchboard.on_fatal = lambda: loop.create_task(stop())
        switchboard.start()
        serving = loop.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            on_ready(lambda: loop.call_soon_threadsafe(lambda: loop.create_task(stop())))
        await serving
        if not switchboard.closing:  # uvicorn stopped on its own (it failed to start)
            await switchboard.shutdown()

    try:
        with one_line_logs(report):
            asyncio.run(main())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sock.close()
    return caught[0] if caught else None



# The loggers of the libraries under the server: uvicorn's, and asyncio's own (its
# "socket.send() raised exception." comes once per write to a connection already lost).
LIBRARY_LOGGERS = ("uvicorn.error", "asyncio")


@contextlib.contextmanager
def one_line_logs(report):
    """While the server runs, what the libraries log goes through `report` (one line a
    second at most), not to the root logger's stderr."""
    one_line = _OneLine(report)
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    was = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(one_line)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, was):
            logger.removeHandler(one_line)
            logger.propagate = propagate


class _OneLine(logging.Handler):
    """uvicorn's log as one line a second at most: its tracebacks would fill a disk under
    attack."""

    def __init__(self, report):
        super().__init__(logging.WARNING)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        what = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            what = f"{what}: {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self.report(" ".join(what.split()))
