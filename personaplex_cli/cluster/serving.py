"""`serve --ray`: engines as Ray Serve applications, behind one ingress that admits callers.

Each engine is a Serve application of its own (`personaplex-engine-K`, behind Serve's proxy
at /personaplex-engine-K/): one replica, on one GPU or a share of the CPUs, running the
server of one machine (serve.server.Server: the model, its ConversationBatch, the
switchboard, the Starlette app) as its ASGI app. The ingress (a FastAPI app at /) is what
callers reach: it checks a caller as the switchboard does (origin, token, connections per
address, the query), admits it to the first engine that is up and has a free slot, and
relays its WebSocket there and back message for message, so NVIDIA's protocol passes through
unchanged and the session stays on that engine to its end. An application per engine rather
than replicas of one deployment: Serve's router sends a request to the replica with the
shortest queue, and cannot be told which has a free slot, nor to refuse a caller when none
has; the ingress can, as it relays every session.

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
import logging
import os
import re
import socket
import sys

ENGINE_APP = "personaplex-engine-{}"
INGRESS_APP = "personaplex"
WATCH_S = 1.0  # how often the ingress asks every engine how it is
ANSWER_S = 3.0  # an engine that does not answer within this is down (or restarting)
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
                 idle_timeout: float, threads: int | None):
        from ..serve.access import Access
        from ..serve.query import Defaults
        from ..serve.server import Server

        if threads:
            import torch

            torch.set_num_threads(threads)

        def log(line: str) -> None:  # into the replica's log file (Ray keeps it)
            print(line, file=sys.stderr, flush=True)

        # The ingress checks origins and connections per address: here every session
        # comes from it, so only the token is checked again.
        self.server = Server.open(model, device, dtype, Defaults(**defaults), Access(token),
                                  max_sessions=max_sessions, idle_timeout=idle_timeout,
                                  static_dir=None, log=log, debug=log, quantize=quantize,
                                  threads=threads)
        log(self.server.capacity.line())

    def __serve_build_asgi_app__(self):
        app, start = self.server.app, self._start

        async def started_app(scope, receive, send):
            start()
            await app(scope, receive, send)

        return started_app

    def _start(self) -> None:
        """The switchboard runs on the loop that serves the app: the first request's."""
        if self.server.switchboard.loop is None:
            self.server.switchboard.start()

    async def seats(self) -> dict:
        self._start()
        switchboard = self.server.switchboard
        return {"slots": switchboard.capacity, "taken": switchboard.seats,
                "sessions": len(switchboard.sessions),
                "host": socket.gethostname(), "pid": os.getpid()}

    async def metrics(self) -> str:
        return self.server.switchboard.metrics()

    async def voices(self) -> dict:
        switchboard = self.server.switchboard
        return {"voices": switchboard.voices(), "default_voice": switchboard.defaults.voice,
                "default_role": switchboard.defaults.role}

    def check_health(self) -> None:
        """Serve's health check: an engine whose thread stopped is restarted."""
        failure = self.server.switchboard.failure
        if failure is not None:
            raise RuntimeError(f"the engine failed: {type(failure).__name__}: {failure}")


@dataclasses.dataclass
class _Engine:
    """An engine as the ingress sees it."""

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
    """The deployment callers reach: admission, the relay, the figures of every engine."""

    def __init__(self, *, engines: int, proxy_port: int, defaults: dict, token: str | None,
                 allow_origins: tuple[str, ...], max_per_client: int):
        from ..serve.access import Access
        from ..serve.query import Defaults

        self.engines = [_Engine(k, ENGINE_APP.format(k)) for k in range(engines)]
        self.proxy_port = proxy_port
        self.defaults = Defaults(**defaults)
        self.access = Access(token, tuple(allow_origins), max_per_client)
        self.counts = collections.Counter()
        self._watching: asyncio.Task | None = None

    def __serve_build_asgi_app__(self):
        from fastapi import FastAPI
        from starlette.routing import Mount, Route, WebSocketRoute
        from starlette.staticfiles import StaticFiles

        from ..serve.app import PAGE_DIR, TokenCookie

        # Starlette's routes: the endpoints take the request or WebSocket as it is.
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, routes=[
            WebSocketRoute("/api/chat", self.chat),
            Route("/api/health", self.health),
            Route("/metrics", self.metrics),
            Route("/api/voices", self.voices),
            Mount("/", StaticFiles(directory=PAGE_DIR, html=True))])
        return TokenCookie(app, self.access)

    # -- the engines ----------------------------------------------------------------------

    def _watch(self) -> None:
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self._watch_engines())

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.gather(*(self._ask(engine) for engine in self.engines))
            await asyncio.sleep(WATCH_S)

    async def _ask(self, engine: _Engine) -> None:
        from ray import serve

        try:
            if engine.handle is None:
                engine.handle = serve.get_app_handle(engine.app)
            seen = await asyncio.wait_for(engine.handle.seats.remote(), ANSWER_S)
        except Exception:  # noqa: BLE001 - not deployed yet, dead, or restarting
            engine.up = False
            return
        if seen["pid"] != engine.lost_pid:  # else asked before it was lost
            engine.seen, engine.slots, engine.up = seen, seen["slots"], True

    def _free_engine(self) -> _Engine | None:
        return next((engine for engine in self.engines
                     if engine.up and engine.taken < engine.slots), None)

    @property
    def capacity(self) -> int:
        return sum(engine.slots for engine in self.engines if engine.up)

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
            engine = self._free_engine()
            if engine is None:
                return await refuse("full", switchboard.slots_taken(self.capacity),
                                    protocol.CLOSE_TRY_AGAIN)
            engine.taken += 1
            self.counts["sessions"] += 1
            try:
                await self._relay(websocket, caller, engine)
            finally:
                engine.taken = max(0, engine.taken - 1)
        finally:
            self.access.disconnect(address)

    async def _relay(self, websocket, caller, engine: _Engine) -> None:
        """The caller's messages to the engine and the engine's back, until either
        closes; the engine's close code goes to the caller as it is."""
        import websockets

        from ..serve import protocol, switchboard

        query = websocket.url.query
        url = (f"ws://127.0.0.1:{self.proxy_port}/{engine.app}/api/chat"
               + (f"?{query}" if query else ""))
        # The token may have come in a header or the page's cookie: the engine checks it.
        forwarded = {key: websocket.headers[key] for key in ("authorization", "cookie")
                     if key in websocket.headers}
        try:
            upstream = await websockets.connect(
                url, additional_headers=forwarded, max_size=protocol.TRANSPORT_MAX_MESSAGE_BYTES,
                open_timeout=ANSWER_S * 10, close_timeout=2, ping_interval=None)
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake):
            engine.lost()
            return await switchboard.refuse(caller, LOST, protocol.CLOSE_INTERNAL)
        told = False  # the engine sent a 0x05 message: its close is its own

        async def down() -> None:
            nonlocal told
            async for message in upstream:
                if isinstance(message, str):
                    await websocket.send_text(message)
                    continue
                told = told or message[:1] == bytes([protocol.ERROR])
                await websocket.send_bytes(message)

        async def up() -> None:
            while (message := await caller.receive()) is not None:
                await upstream.send(message)

        downward = asyncio.ensure_future(down())
        upward = asyncio.ensure_future(up())
        try:
            await asyncio.wait({downward, upward}, return_when=asyncio.FIRST_COMPLETED)
            # The caller went away, or failed: anything but a send to an engine gone.
            caller_left = upward.done() and not isinstance(upward.exception(),
                                                           websockets.ConnectionClosed)
            if caller_left:  # tell the engine, and let its last messages go
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
            engine.lost()  # until the watcher hears from its next process
            self.counts["lost"] += 1
            return await switchboard.refuse(caller, LOST, protocol.CLOSE_INTERNAL)
        with _quietly():
            await caller.close(code or protocol.CLOSE_NORMAL)

    # -- what the API tells ---------------------------------------------------------------

    async def health(self, request):
        from starlette.responses import JSONResponse

        self._watch()
        replicas = [{"replica": engine.number, "status": "ok" if engine.up else "down",
                     "slots": engine.slots if engine.up else 0, "taken": engine.taken,
                     "sessions": engine.seen.get("sessions", 0) if engine.up else 0,
                     "host": engine.seen.get("host"), "pid": engine.seen.get("pid")}
                    for engine in self.engines]
        up = [replica for replica in replicas if replica["status"] == "ok"]
        return JSONResponse({"status": "ok" if up else "down",
                             "sessions": sum(r["sessions"] for r in up),
                             "slots": sum(r["slots"] for r in up),
                             "taken": sum(engine.taken for engine in self.engines),
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
        for engine in self.engines:
            if engine.up:
                with _quietly():
                    texts[str(engine.number)] = await asyncio.wait_for(
                        engine.handle.metrics.remote(), ANSWER_S)
        x = Exposition()
        x.add("replicas", "gauge", "Engine replicas of the deployment, by state.",
              [({"state": "up"}, sum(e.up for e in self.engines)),
               ({"state": "total"}, len(self.engines))])
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
        self._watch()
        for engine in self.engines:
            if engine.up:
                with _quietly():
                    return JSONResponse(await asyncio.wait_for(engine.handle.voices.remote(),
                                                               ANSWER_S))
        return PlainTextResponse("no replica is up yet: try again later\n", 503)


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

        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
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
           max_per_client: int, max_sessions: int | None, idle_timeout: float) -> Deployment:
    """Starts Serve's proxy on host:port (unless Serve runs on the cluster already) and the
    engines and the ingress; returns once Serve has them running."""
    from ray import serve
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import LoggingConfig

    from ..serve.server import MOST_SESSIONS
    from .runtime import model_spec_for_nodes

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
    targets = [serve.RunTarget(engine.bind(
        model=model_spec_for_nodes(model), device="cuda" if pool.gpus else "cpu",
        dtype=dtype, quantize=quantize, defaults=dataclasses.asdict(defaults), token=token,
        max_sessions=max_sessions, idle_timeout=idle_timeout, threads=threads),
        name=ENGINE_APP.format(k), route_prefix=f"/{ENGINE_APP.format(k)}")
        for k in range(pool.workers)]
    targets.append(serve.RunTarget(ingress.bind(
        engines=pool.workers, proxy_port=port, defaults=dataclasses.asdict(defaults),
        token=token, allow_origins=allow_origins, max_per_client=max_per_client),
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
