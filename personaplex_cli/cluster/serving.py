"""`serve --ray`: engines as Ray Serve applications, behind one ingress that admits callers.

Each engine is a Serve application of its own (`personaplex-engine-K`, behind Serve's proxy
at /personaplex-engine-K/): one replica, on one GPU or a share of the CPUs, running the
server of one machine (serve.server.Server: the model, its runtime Scheduler, the
switchboard, the Starlette app) as its ASGI app. The ingress (a FastAPI app at /) is what
callers reach: it checks a caller as the switchboard does (origin, token, connections per
address, the query), admits it to the first engine that is up and has a free slot, and
relays its WebSocket there and back message for message, so NVIDIA's protocol passes through
unchanged and the session stays on that engine to its end. OpenAI's routes go the same way:
`/v1/realtime` is relayed as `/api/chat` is, `POST /v1/chat/completions` and `POST
/api/reply` are read here (to the switchboard's limits), sent to a free engine through
Serve's proxy, and their answer, a stream of server-sent events too, relayed back as it
comes; `/v1/models` is any engine's. The ingress checks Host as one machine's server does
(421; --allow-host). Serve's proxy also routes /personaplex-engine-K/ to the engines: they
answer only requests that carry the deployment's relay key (a header the ingress adds; a
fresh secret each deployment), so nobody reaches an engine past the ingress's checks.

An application per engine rather than replicas of one deployment: Serve's router sends a
request to the replica with the shortest queue, and cannot be told which has a free slot,
nor to refuse a caller when none has; the ingress can, as it relays every session.

When every slot of every engine is taken, a caller gets the switchboard's refusal, counting
all slots. An engine that dies (its process killed, its machine lost) ends the sessions
relayed to it with a 0x05 message and a close (1011); new callers go to the others until
Serve has restarted it and it answers again. `/api/health` and `/metrics` sum and label
every engine's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import logging
import os
import re
import secrets
import socket
import sys

ENGINE_APP = "personaplex-engine-{}"
REALTIME_PATH = "/v1/realtime"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
REPLY_PATH = "/api/reply"
RELAY_HEADER = "x-personaplex-relay"  # the deployment's key: the ingress relayed this
# Headers a relayed request keeps: the token (a header or the page's cookie: the engine
# checks it) and what OpenAI's clients say of the API they speak.
FORWARDED = ("authorization", "cookie", "openai-beta", "content-type", "accept")
INGRESS_APP = "personaplex"
WATCH_S = 1.0  # how often the ingress asks every engine how it is
ANSWER_S = 3.0  # an engine that does not answer within this is down (or restarting)
NONE_UP = "no replica is up yet: try again later"
LOST = "the server's replica that held this session stopped: call again"
NORMAL_CLOSES = (1000, 1001)  # a close the engine meant, without a 0x05 message


def is_engine(actor_name: str) -> bool:
    """Whether a Ray actor is one of our engines (Serve names it after its application):
    their session lines are the server's log."""
    return actor_name.startswith("ServeReplica:" + ENGINE_APP.format(""))


class EngineReplica:
    """One engine: serve.server.Server as the replica's ASGI app, and what the ingress
    asks of it through a Serve handle."""

    def __init__(self, *, model: str, device: str, dtype: str | None, quantize: str,
                 defaults: dict, token: str | None, max_sessions: int | None,
                 idle_timeout: float, threads: int | None, relay_key: str,
                 max_prime_s: float, graphs: bool | None = None):
        from ..errors import PersonaplexError
        from ..serve.access import Access
        from ..serve.query import Defaults
        from ..serve.server import Server

        if threads:
            import torch

            torch.set_num_threads(threads)

        def log(line: str) -> None:  # into the replica's log file (Ray keeps it)
            print(line, file=sys.stderr, flush=True)

        self.relay_key = relay_key
        self.refused: PersonaplexError | None = None
        # The ingress checks origins and connections per address: here every session
        # comes from it, so only the token is checked again.
        try:
            self.server = Server.open(model, device, dtype, Defaults(**defaults), Access(token),
                                      max_sessions=max_sessions, idle_timeout=idle_timeout,
                                      static_dir=None, log=log, debug=log, quantize=quantize,
                                      threads=threads, max_prime_s=max_prime_s,
                                      graphs=graphs)
        except PersonaplexError as error:  # the model missing, the prompt over a limit...
            # told to the command through `seats`, in its words: raised here, Serve would
            # restart the replica, fail again and say only that the deployment failed.
            self.server, self.refused = None, error
            log(f"refused to start: {error.message}")
            return
        log(self.server.capacity.line())

    def __serve_build_asgi_app__(self):
        from starlette.applications import Starlette

        # A replica that refused to start answers nothing (404), and Serve's lifespan.
        app = Starlette() if self.server is None else self.server.app
        start, key = self._start, self.relay_key.encode()

        async def started_app(scope, receive, send):
            if scope["type"] in ("http", "websocket") and not _relayed(scope, key):
                return await _not_here(scope, receive, send)
            start()
            await app(scope, receive, send)

        return started_app

    def _start(self) -> None:
        """The switchboard runs on the loop that serves the app: the first request's."""
        if self.server is not None and self.server.switchboard.loop is None:
            self.server.switchboard.start()

    async def seats(self) -> dict:
        if self.refused is not None:
            return {"refused": self.refused.message, "exit_code": self.refused.exit_code,
                    "slots": 0, "pid": os.getpid()}
        self._start()
        switchboard = self.server.switchboard
        return {"slots": switchboard.capacity, "taken": switchboard.seats,
                "sessions": len(switchboard.sessions),
                "host": socket.gethostname(), "pid": os.getpid()}

    async def metrics(self) -> str:
        return self.server.switchboard.metrics()

    async def models(self) -> dict:
        from ..serve.openai_models import model_list

        return model_list(int(self.server.switchboard.started_at))

    async def voices(self) -> dict:
        switchboard = self.server.switchboard
        return {"voices": switchboard.voices(), "default_voice": switchboard.defaults.voice,
                "default_role": switchboard.defaults.role}

    def check_health(self) -> None:
        """Serve's health check: an engine whose thread stopped is restarted (one that
        refused to start stays, to say why)."""
        if self.server is None:
            return
        failure = self.server.switchboard.failure
        if failure is not None:
            raise RuntimeError(f"the engine failed: {type(failure).__name__}: {failure}")


def _relayed(scope, key: bytes) -> bool:
    """Whether a request to an engine came through the ingress (it carries the key)."""
    given = dict(scope["headers"]).get(RELAY_HEADER.encode(), b"")
    return hmac.compare_digest(given, key)


async def _not_here(scope, receive, send) -> None:
    """What an engine answers a request that did not come through the ingress: 404, as if
    the path were not there (a WebSocket is closed before it opens)."""
    from starlette.responses import PlainTextResponse
    from starlette.websockets import WebSocket

    if scope["type"] == "websocket":
        await WebSocket(scope, receive, send).close(code=1008)
    else:
        await PlainTextResponse("Not Found\n", 404)(scope, receive, send)


@dataclasses.dataclass
class _Replica:
    """An engine's replica as the ingress sees it."""

    number: int
    app: str
    handle: object = None
    up: bool = False
    slots: int = 0
    taken: int = 0  # sessions the ingress relays to it now
    seen: dict = dataclasses.field(default_factory=dict)  # its last answer to `seats`
    lost_pid: int | None = None  # the process that was lost: its late answers are stale

    def lost(self) -> None:
        self.up, self.lost_pid = False, self.seen.get("pid")


class Ingress:
    """The deployment callers reach: admission, the relay, the figures of every replica."""

    def __init__(self, *, engines: int, proxy_port: int, defaults: dict, token: str | None,
                 allow_origins: tuple[str, ...], max_per_client: int, hosts, relay_key: str):
        from ..serve.access import Access
        from ..serve.query import Defaults

        self.replicas = [_Replica(k, ENGINE_APP.format(k)) for k in range(engines)]
        self.proxy_port = proxy_port
        self.defaults = Defaults(**defaults)
        self.access = Access(token, tuple(allow_origins), max_per_client, hosts)
        self.relay_key = relay_key
        self.counts = collections.Counter()
        self._watching: asyncio.Task | None = None

    def __serve_build_asgi_app__(self):
        from fastapi import FastAPI
        from starlette.routing import Mount, Route, WebSocketRoute
        from starlette.staticfiles import StaticFiles

        from ..serve.app import PAGE_DIR, HostCheck, TokenCookie

        # Starlette's routes: the endpoints take the request or WebSocket as it is.
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, routes=[
            WebSocketRoute("/api/chat", self.chat),
            WebSocketRoute(REALTIME_PATH, self.realtime),
            Route(CHAT_COMPLETIONS_PATH, self.chat_completions, methods=["POST"]),
            Route(REPLY_PATH, self.reply, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/api/health", self.health),
            Route("/metrics", self.metrics),
            Route("/api/voices", self.voices),
            Mount("/", StaticFiles(directory=PAGE_DIR, html=True))])
        return HostCheck(TokenCookie(app, self.access), self.access, self.counts)

    # -- the engines ----------------------------------------------------------------------

    def _watch(self) -> None:
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self._watch_engines())

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.gather(*(self._ask(replica) for replica in self.replicas))
            await asyncio.sleep(WATCH_S)

    async def _ask(self, replica: _Replica) -> None:
        from ray import serve

        try:
            if replica.handle is None:
                replica.handle = serve.get_app_handle(replica.app)
            seen = await asyncio.wait_for(replica.handle.seats.remote(), ANSWER_S)
        except Exception:  # noqa: BLE001 - not deployed yet, dead, or restarting
            replica.up = False
            return
        if seen["pid"] != replica.lost_pid:  # else asked before it was lost
            replica.seen, replica.slots = seen, seen["slots"]
            replica.up = "refused" not in seen

    def _free_replica(self) -> _Replica | None:
        return next((replica for replica in self.replicas
                     if replica.up and replica.taken < replica.slots), None)

    @property
    def capacity(self) -> int:
        return sum(replica.slots for replica in self.replicas if replica.up)

    # -- a caller -------------------------------------------------------------------------

    async def chat(self, websocket) -> None:
        from ..serve import protocol, switchboard
        from ..serve.app import transport
        from ..serve.query import QueryError, parse_call

        self._watch()
        if not self.access.origin_allowed(websocket.headers):
            self.counts["refused:origin"] += 1
            await websocket.close(code=protocol.CLOSE_POLICY)  # the browser sees a 403
            return
        await websocket.accept()
        caller = transport(websocket)
        query, headers = websocket.query_params, websocket.headers
        address = websocket.client.host if websocket.client else "unknown"

        async def refuse(why: str, message: str, code: int) -> None:
            self.counts[f"refused:{why}"] += 1
            await switchboard.refuse(caller, message, code)

        if not self.access.authorised(query, headers):
            return await refuse("token", switchboard.TOKEN_NEEDED, protocol.CLOSE_POLICY)
        if not self.access.connect(address):
            return await refuse("per-client", switchboard.too_many_from(
                address, self.access.max_per_client), protocol.CLOSE_TRY_AGAIN)
        try:
            try:
                parse_call(query, self.defaults, len(websocket.url.query.encode()))
            except QueryError as error:
                return await refuse("query", error.message, protocol.CLOSE_POLICY)
            replica = self._free_replica()
            if replica is None:
                return await refuse("full", switchboard.slots_taken(self.capacity),
                                    protocol.CLOSE_TRY_AGAIN)
            replica.taken += 1
            self.counts["sessions"] += 1
            try:
                await self._relay(websocket, caller, replica, "/api/chat",
                                  lambda message: message[:1] == bytes([protocol.ERROR]),
                                  lambda message, code: switchboard.refuse(caller, message,
                                                                           code))
            finally:
                replica.taken = max(0, replica.taken - 1)
        finally:
            self.access.disconnect(address)

    async def realtime(self, websocket) -> None:
        """`/v1/realtime` (OpenAI's Realtime protocol, the engine's to speak): admitted as
        a caller of /api/chat is, and relayed there and back as it is; a refusal here is
        the protocol's `error` event, then the close."""
        from ..serve import protocol, realtime, switchboard
        from ..serve.app import transport

        self._watch()
        if not self.access.origin_allowed(websocket.headers):
            self.counts["refused:origin"] += 1
            await websocket.close(code=protocol.CLOSE_POLICY)
            return
        await websocket.accept()
        caller = transport(websocket, text=True)
        address = websocket.client.host if websocket.client else "unknown"

        async def refuse(message: str, code: int, why: str | None = None) -> None:
            if why:
                self.counts[f"refused:{why}"] += 1
            await realtime.refuse(caller, message, code)

        if not self.access.authorised(websocket.query_params, websocket.headers):
            return await refuse(switchboard.TOKEN_NEEDED, protocol.CLOSE_POLICY, "token")
        if not self.access.connect(address):
            return await refuse(switchboard.too_many_from(address, self.access.max_per_client),
                                protocol.CLOSE_TRY_AGAIN, "per-client")
        try:
            replica = self._free_replica()
            if replica is None:
                return await refuse(switchboard.slots_taken(self.capacity),
                                    protocol.CLOSE_TRY_AGAIN, "full")
            replica.taken += 1
            self.counts["sessions"] += 1
            try:
                await self._relay(websocket, caller, replica, REALTIME_PATH,
                                  _is_error_event, refuse)
            finally:
                replica.taken = max(0, replica.taken - 1)
        finally:
            self.access.disconnect(address)

    async def _relay(self, websocket, caller, replica: _Replica, path: str, is_error,
                     refuse) -> None:
        """The caller's messages to the engine's `path` and the engine's back, until
        either closes; the engine's close code goes to the caller as it is. `is_error(
        message)`: the replica said why it closes; `refuse(message, code)` tells the caller
        in its protocol."""
        import websockets

        from ..serve import protocol

        query = websocket.url.query
        url = (f"ws://127.0.0.1:{self.proxy_port}/{replica.app}{path}"
               + (f"?{query}" if query else ""))
        forwarded = self._forwarded(websocket.headers)
        try:
            upstream = await websockets.connect(
                url, additional_headers=forwarded, max_size=protocol.TRANSPORT_MAX_MESSAGE_BYTES,
                open_timeout=ANSWER_S * 10, close_timeout=2, ping_interval=None)
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake):
            replica.lost()
            return await refuse(LOST, protocol.CLOSE_INTERNAL)
        told = False  # the replica said why: its close is its own

        async def down() -> None:
            nonlocal told
            async for message in upstream:
                told = told or is_error(message)
                if isinstance(message, str):
                    await websocket.send_text(message)
                else:
                    await websocket.send_bytes(message)

        async def up() -> None:
            while (message := await caller.receive()) is not None:
                await upstream.send(message)

        downward = asyncio.ensure_future(down())
        upward = asyncio.ensure_future(up())
        try:
            await asyncio.wait({downward, upward}, return_when=asyncio.FIRST_COMPLETED)
            # The caller went away, or failed: anything but a send to a replica gone.
            caller_left = upward.done() and not isinstance(upward.exception(),
                                                           websockets.ConnectionClosed)
            if caller_left:  # tell the replica, and let its last messages go
                with _quietly():
                    await upstream.close()
                    await asyncio.wait_for(downward, 2)
                return
            with _quietly():
                await asyncio.wait_for(asyncio.shield(downward), 2)
        finally:
            for task in (upward, downward):
                task.cancel()
                with _quietly():
                    await task
        code = upstream.close_code
        if not told and code not in NORMAL_CLOSES:
            replica.lost()  # until the watcher hears from its next process
            self.counts["lost"] += 1
            return await refuse(LOST, protocol.CLOSE_INTERNAL)
        with _quietly():
            await caller.close(code or protocol.CLOSE_NORMAL)

    def _forwarded(self, headers) -> dict:
        """The headers a relayed request keeps, and the key that lets it reach a replica."""
        kept = {key: headers[key] for key in FORWARDED if key in headers}
        return {**kept, RELAY_HEADER: self.relay_key}

    async def chat_completions(self, request):
        """`POST /v1/chat/completions`: its refusals in OpenAI's error JSON."""
        from starlette.responses import Response

        from ..serve.app import openai_refusal
        from ..serve.chat import error_body

        return await self._relay_post(
            request, CHAT_COMPLETIONS_PATH, openai_refusal,
            lambda status, message: Response(error_body(status, message), status,
                                             media_type="application/json"))

    async def reply(self, request):
        """`POST /api/reply`: its refusals in plain text, as one machine's server says them."""
        from starlette.responses import PlainTextResponse

        from ..serve.app import refusal

        return await self._relay_post(
            request, REPLY_PATH, refusal,
            lambda status, message: PlainTextResponse(message + "\n", status))

    async def _relay_post(self, request, path: str, refusal, answer):
        """A POST admitted as a caller is (its answer holds a slot while it is computed)
        and relayed to that engine's `path` with its query; the answer, a stream too, comes
        back as the replica sends it. The body is read here first, with the engine's own
        limits, so a slow body holds no engine's slot. `refusal(access, request)`: the
        route's answer to a page of another origin or a missing token; `answer(status,
        message)`: a refusal in the route's shape."""
        from starlette.responses import Response, StreamingResponse

        from ..serve import switchboard

        def refused(status: int, message: str, why: str) -> Response:
            self.counts[f"refused:{why}"] += 1
            return answer(status, message)

        self._watch()
        refused_here = refusal(self.access, request)
        if refused_here is not None:
            return refused_here
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > switchboard.MAX_REPLY_BYTES:
            return refused(413, switchboard.too_big(int(declared)), "size")
        address = request.client.host if request.client else "unknown"
        if self._free_replica() is None:
            return refused(503, switchboard.slots_taken(self.capacity), "full")
        if not self.access.connect(address):
            return refused(429, switchboard.too_many_from(address,
                                                          self.access.max_per_client),
                           "per-client")
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.access.disconnect(address)

        try:
            body = await _whole_body(request)
        except _BodyRefused as error:
            release()
            return refused(error.status, error.message, error.why)
        replica = self._free_replica()
        if replica is None:
            release()
            return refused(503, switchboard.slots_taken(self.capacity), "full")
        replica.taken += 1
        query = request.url.query
        try:
            status, content_type, chunks = await _post(
                self.proxy_port, f"/{replica.app}{path}" + (f"?{query}" if query else ""),
                self._forwarded(request.headers), body)
        except OSError:
            replica.taken = max(0, replica.taken - 1)
            release()
            replica.lost()
            return refused(503, LOST, "lost")

        async def relayed():
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()
                replica.taken = max(0, replica.taken - 1)
                release()

        return StreamingResponse(relayed(), status, media_type=content_type)

    async def models(self, request):
        from starlette.responses import JSONResponse, Response

        from ..serve.app import openai_refusal
        from ..serve.chat import error_body

        refused = openai_refusal(self.access, request)
        if refused is not None:
            return refused
        answer = await self._any_engine("models")
        if answer is None:
            return Response(error_body(503, NONE_UP), 503, media_type="application/json")
        return JSONResponse(answer)

    async def _any_engine(self, method: str):
        """The first replica up's answer to its `method` (a handle call), None if none
        answers."""
        self._watch()
        for replica in self.replicas:
            if replica.up:
                with _quietly():
                    return await asyncio.wait_for(getattr(replica.handle, method).remote(),
                                                  ANSWER_S)
        return None

    # -- what the API tells ---------------------------------------------------------------

    async def health(self, request):
        from starlette.responses import JSONResponse

        self._watch()
        replicas = [{"replica": replica.number, "status": "ok" if replica.up else "down",
                     "slots": replica.slots if replica.up else 0, "taken": replica.taken,
                     "sessions": replica.seen.get("sessions", 0) if replica.up else 0,
                     "host": replica.seen.get("host"), "pid": replica.seen.get("pid"),
                     **({"refused": replica.seen["refused"],
                         "exit_code": replica.seen["exit_code"]}
                        if "refused" in replica.seen else {})}
                    for replica in self.replicas]
        up = [replica for replica in replicas if replica["status"] == "ok"]
        return JSONResponse({"status": "ok" if up else "down",
                             "sessions": sum(r["sessions"] for r in up),
                             "slots": sum(r["slots"] for r in up),
                             "taken": sum(replica.taken for replica in self.replicas),
                             "replicas": replicas})

    async def metrics(self, request):
        from starlette.responses import Response

        from ..serve.app import refusal
        from ..serve.metrics import CONTENT_TYPE, Exposition

        refused = refusal(self.access, request)
        if refused is not None:
            return refused
        self._watch()
        texts = {}
        for replica in self.replicas:
            if replica.up:
                with _quietly():
                    texts[str(replica.number)] = await asyncio.wait_for(
                        replica.handle.metrics.remote(), ANSWER_S)
        x = Exposition()
        x.add("replicas", "gauge", "Engine replicas of the deployment, by state.",
              [({"state": "up"}, sum(e.up for e in self.replicas)),
               ({"state": "total"}, len(self.replicas))])
        x.add("ingress_refused_total", "counter", "Callers the ingress refused, by reason.",
              [({"reason": key.split(":", 1)[1]}, value)
               for key, value in sorted(self.counts.items()) if key.startswith("refused:")]
              or None)
        x.add("ingress_lost_total", "counter", "Sessions ended because their replica "
              "stopped.", self.counts["lost"])
        return Response(x.text() + labelled(texts), media_type=CONTENT_TYPE)

    async def voices(self, request):
        from starlette.responses import JSONResponse, PlainTextResponse

        from ..serve.app import refusal

        refused = refusal(self.access, request)
        if refused is not None:
            return refused
        answer = await self._any_engine("voices")
        if answer is None:
            return PlainTextResponse(NONE_UP + "\n", 503)
        return JSONResponse(answer)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (.*)$")


def labelled(texts: dict[str, str]) -> str:
    """Prometheus texts of several engines as one: each family once, every sample with
    the label replica="K" of the engine it came from."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = collections.defaultdict(list)
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                headers.setdefault(family, [])
                if len(headers[family]) < 2:
                    headers[family].append(line)
                continue
            found = _SAMPLE.match(line)
            if found is None or family is None:
                continue
            name, labels, value = found.groups()
            tag = f'replica="{replica}"' + (f",{labels}" if labels else "")
            samples[family].append(f"{name}{{{tag}}} {value}")
    return "".join("\n".join(lines + samples[family]) + "\n"
                   for family, lines in headers.items())


def _is_error_event(message) -> bool:
    """Whether an engine's Realtime message is an `error` event."""
    import json

    if not isinstance(message, str) or '"error"' not in message:
        return False
    try:
        return json.loads(message).get("type") == "error"
    except (ValueError, AttributeError):
        return False


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str, why: str):
        super().__init__(message)
        self.status, self.message, self.why = status, message, why


async def _whole_body(request) -> bytes:
    """A request's body, held to the switchboard's limits on size and pace."""
    import time

    from starlette.requests import ClientDisconnect

    from ..serve import switchboard

    chunks, size, began = [], 0, time.monotonic()
    stream = aiter(request.stream())
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), switchboard.BODY_PAUSE_S)
            except StopAsyncIteration:
                return b"".join(chunks)
            size += len(chunk)
            if size > switchboard.MAX_REPLY_BYTES:
                raise _BodyRefused(413, switchboard.too_big(size), "size")
            chunks.append(chunk)
            spent = time.monotonic() - began
            if spent > switchboard.BODY_PAUSE_S and size < switchboard.LEAST_BODY_RATE * spent:
                raise asyncio.TimeoutError
    except asyncio.TimeoutError:
        raise _BodyRefused(408, "the request's body came too slowly", "slow upload") from None
    except ClientDisconnect:
        raise _BodyRefused(400, switchboard.CLIENT_WENT, "gone") from None


async def _post(port: int, path: str, headers: dict, body: bytes):
    """POST to Serve's proxy on this machine -> (status, content type, the answer's body
    as an async iterator of chunks, as they come)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}",
            f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{key}: {value}" for key, value in headers.items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    answer_headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        answer_headers[key.strip().lower()] = value.strip()

    async def chunks():
        try:
            if answer_headers.get("transfer-encoding", "").lower() == "chunked":
                while (size := int((await reader.readline()).split(b";")[0], 16)):
                    yield await reader.readexactly(size)
                    await reader.readline()
            elif "content-length" in answer_headers:
                yield await reader.readexactly(int(answer_headers["content-length"]))
            else:
                while chunk := await reader.read(65536):
                    yield chunk
        finally:
            writer.close()

    return status, answer_headers.get("content-type", "application/octet-stream"), chunks()


def _quietly():
    """Suppresses what a connection that went away raises while it is being ended."""
    return contextlib.suppress(Exception, asyncio.CancelledError)


# -- the command's side -----------------------------------------------------------------------

READY_S = 600.0  # the engines load and warm up their model (a 7B one from a cold cache)


@dataclasses.dataclass
class Deployment:
    """The applications `serve --ray` runs, and whether it started Serve itself."""

    engines: int
    local_url: str  # the ingress, as this machine reaches it
    started_serve: bool

    def health(self) -> dict | None:
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(self.local_url + "api/health", timeout=5) as answer:
                return json.loads(answer.read())
        except (OSError, ValueError):
            return None

    def wait_ready(self, timeout: float = READY_S) -> dict:
        """Until every engine answers the ingress -> its /api/health."""
        import time

        from ..errors import ClusterError

        from .ray_cluster import remote_error

        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            for replica in (health or {}).get("replicas", []):
                if "refused" in replica:  # what one machine's serve would have said
                    raise remote_error(replica["refused"], replica["exit_code"])
            if health and all(r["status"] == "ok" for r in health["replicas"]):
                return health
            if time.monotonic() > deadline:
                raise ClusterError(f"the replicas were not up after {timeout:.0f} s: "
                                   f"{health}")
            time.sleep(0.2)

    def close(self) -> None:
        from ray import serve

        for name in [INGRESS_APP] + [ENGINE_APP.format(k) for k in range(self.engines)]:
            with contextlib.suppress(Exception):
                serve.delete(name)
        if self.started_serve:
            serve.shutdown()


def deploy(pool, *, host: str, port: int, model: str, device: str, dtype: str | None,
           quantize: str, defaults, token: str | None, allow_origins: tuple[str, ...],
           max_per_client: int, max_sessions: int | None, idle_timeout: float, hosts,
           max_prime_s: float, graphs: bool | None = None) -> Deployment:
    """Starts Serve's proxy on host:port (unless Serve runs on the cluster already) and the
    engines and the ingress; returns once Serve has them running."""
    from ray import serve
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import LoggingConfig

    from ..runtime.limits import MOST_SESSIONS
    from .ray_cluster import model_spec_for_nodes

    # Serve's own lines (one per request) stay in its log files.
    quiet_logs = LoggingConfig(log_level="WARNING", enable_access_log=False)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    started_serve = not _serve_running()
    if started_serve:
        serve.start(http_options=HTTPOptions(host=host, port=port), logging_config=quiet_logs)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # here too: "app is ready"
    per_engine = max_sessions or MOST_SESSIONS
    engine = serve.deployment(serve.ingress()(EngineReplica), name="engine", num_replicas=1,
                              ray_actor_options=pool.resources,
                              # sessions, and the health and figure requests beside them
                              max_ongoing_requests=per_engine + 16,
                              health_check_period_s=2.0,
                              graceful_shutdown_timeout_s=5.0, logging_config=quiet_logs)
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=2 * per_engine * pool.workers + 64,
                               logging_config=quiet_logs)
    threads = None if pool.gpus else pool.resources["num_cpus"]
    relay_key = secrets.token_urlsafe(24)
    targets = [serve.RunTarget(engine.bind(
        model=model_spec_for_nodes(model), device="cuda" if pool.gpus else "cpu",
        dtype=dtype, quantize=quantize, defaults=dataclasses.asdict(defaults), token=token,
        max_sessions=max_sessions, idle_timeout=idle_timeout, threads=threads,
        relay_key=relay_key, max_prime_s=max_prime_s, graphs=graphs),
        name=ENGINE_APP.format(k), route_prefix=f"/{ENGINE_APP.format(k)}")
        for k in range(pool.workers)]
    targets.append(serve.RunTarget(ingress.bind(
        engines=pool.workers, proxy_port=port, defaults=dataclasses.asdict(defaults),
        token=token, allow_origins=allow_origins, max_per_client=max_per_client,
        hosts=hosts, relay_key=relay_key),
        name=INGRESS_APP, route_prefix="/"))
    deployment = Deployment(pool.workers, f"http://{_loopback(host)}:{port}/", started_serve)
    try:
        serve.run_many(targets, wait_for_applications_running=True)
    except BaseException:
        deployment.close()
        raise
    return deployment


def _serve_running() -> bool:
    import ray

    try:
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    except ValueError:
        return False
    return True


def _loopback(host: str) -> str:
    """How this machine reaches a proxy bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
