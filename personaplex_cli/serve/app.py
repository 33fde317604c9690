"""The web application: Starlette routes over the switchboard (the only module that knows
Starlette).

    GET  /api/chat     WebSocket: NVIDIA's protocol (serve/protocol.py)
    GET  /v1/realtime  WebSocket: OpenAI's Realtime API (serve/realtime.py)
    POST /api/reply    a recording in the body -> the reply as WAV (or JSON)
    POST /v1/chat/completions   OpenAI's and SGLang-Omni's audio chat (serve/chat.py)
    GET  /v1/models    the served model's ids (serve/openai_models.py)
    GET  /api/voices   the voices a caller may name, and the server's defaults
    GET  /api/health   "ok", with the seats taken (no token needed)
    GET  /metrics      Prometheus text
    GET  /...          our page (serve/page), or the folder given with --static

Another ASGI host mounts the same endpoint with its own router:
`router.websocket("/api/chat")(chat_endpoint(switchboard))`, after `switchboard.start()` on
the loop that serves it (the engine thread posts its frames to that loop). `serve --ray` runs
this whole app in each engine replica, and its ingress (cluster/serving.py) takes `transport`,
`refusal` and `TokenCookie` from here.
"""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (JSONResponse, PlainTextResponse, Response,
                                 StreamingResponse)
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from .access import COOKIE
from .call import Callables, Cut
from .connections import CUT_KEY, CUT_REASON
from .metrics import CONTENT_TYPE as METRICS_TYPE
from .openai_models import model_list
from .protocol import CLOSE_POLICY
from .switchboard import BEARER_NEEDED, TOKEN_NEEDED, ClientGone, Switchboard

PAGE_DIR = Path(__file__).parent / "page"


def transport(websocket: WebSocket, text: bool = False) -> Callables:
    """An accepted WebSocket as a session.Transport (sending text messages with `text`).
    A socket the server cut (its scope marked CUT_KEY) raises Cut from whichever of receive
    and send meets the cut first."""

    async def receive():
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            if websocket.scope.get(CUT_KEY):
                raise Cut(CUT_REASON)
            return None
        data = message.get("bytes")
        return data if data is not None else (message.get("text") or "")

    send_one = websocket.send_text if text else websocket.send_bytes

    async def send(data) -> None:
        try:
            await send_one(data)
        except Exception:
            if websocket.scope.get(CUT_KEY):
                raise Cut(CUT_REASON) from None
            raise

    async def close(code: int) -> None:
        await websocket.close(code)

    return Callables(receive, send, close)


def refusal(access, request: Request, token_needed: str = TOKEN_NEEDED) -> Response | None:
    """The answer to an API request from a page of another origin, or without the token;
    None when it may go on."""
    if not access.origin_allowed(request.headers):
        return PlainTextResponse("cross-origin requests are refused (see --allow-origin)\n",
                                 403)
    if not access.authorised(request.query_params, request.headers):
        return PlainTextResponse(token_needed + "\n", 401)
    return None


def openai_refusal(access, request: Request) -> Response | None:
    """`refusal`'s answer in OpenAI's error JSON, for the /v1 routes (whose clients send
    the token as a Bearer header)."""
    from .chat import error_body

    refused = refusal(access, request, BEARER_NEEDED)
    if refused is None:
        return None
    return Response(error_body(refused.status_code, refused.body.decode().strip()),
                    refused.status_code, media_type="application/json")


class _Stream(StreamingResponse):
    """A streamed answer whose `done` runs once it has gone out, failed to, or been cut:
    what it holds (a slot) is held until then."""

    def __init__(self, answer):
        super().__init__(answer.body, answer.status, media_type=answer.content_type,
                         headers={"cache-control": "no-cache"})
        self.done = answer.done

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.done()


def _body(request: Request):
    """A request's body as chunks; ClientGone when its client goes while it comes."""

    async def chunks():
        try:
            async for chunk in request.stream():
                yield chunk
        except ClientDisconnect:
            raise ClientGone from None

    return chunks()


def _client_gone(request: Request):
    """Returns when the request's client has gone (once its body is read)."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return gone


async def turned_away(switchboard: Switchboard, websocket: WebSocket,
                      token_needed: str = TOKEN_NEEDED) -> bool:
    """Before the upgrade, on every WebSocket route: a caller without the token gets a
    plain 401 and no socket; a page of another origin, close 1008 (the browser sees 403)."""
    if not switchboard.access.authorised(websocket.query_params, websocket.headers):
        switchboard.counts["refused:token"] += 1
        await websocket.send_denial_response(PlainTextResponse(token_needed + "\n", 401))
        return True
    if not switchboard.access.origin_allowed(websocket.headers):
        switchboard.counts["refused:origin"] += 1
        switchboard.debug(f"refused a page of {ascii(websocket.headers.get('origin'))}: "
                          "cross-origin (see --allow-origin)")
        await websocket.close(code=1008)
        return True
    return False


def chat_endpoint(switchboard: Switchboard):
    """The `/api/chat` WebSocket endpoint, for any Starlette or FastAPI router."""

    async def chat(websocket: WebSocket) -> None:
        if await turned_away(switchboard, websocket):
            return
        await websocket.accept()
        client = websocket.client
        await switchboard.converse(transport(websocket), websocket.query_params,
                           len(websocket.url.query.encode()),
                           websocket.headers, (client.host, client.port) if client
                           else ("unknown", 0))

    return chat


def realtime_endpoint(switchboard: Switchboard):
    """The `/v1/realtime` WebSocket endpoint (OpenAI's Realtime API), for any router: the
    same access rules as `/api/chat` (the token as `Authorization: Bearer`), `?model=`
    checked against serve/openai_models.py, then the switchboard's admission."""
    from . import realtime
    from .openai_models import is_served, unknown_model

    async def endpoint(websocket: WebSocket) -> None:
        if await turned_away(switchboard, websocket, BEARER_NEEDED):
            return
        await websocket.accept()
        wire = transport(websocket, text=True)
        client = websocket.client
        who = (client.host, client.port) if client else ("unknown", 0)
        model = websocket.query_params.get("model")
        if model is not None and not is_served(model):
            return await switchboard.refuse_caller(
                wire, "model", f"{who[0]}:{who[1]}", unknown_model(model),
                CLOSE_POLICY, realtime.refuse)
        query = websocket.query_params
        beta = realtime.is_beta(websocket.headers)

        async def serve(wire, request, caller):
            await realtime.serve_realtime(switchboard, wire, request, caller, query=query,
                                          beta=beta)

        await switchboard.converse(wire, query, len(websocket.url.query.encode()),
                                   websocket.headers, who, serve=serve, say=realtime.refuse)

    return endpoint


def build_app(switchboard: Switchboard, static_dir: Path | None = None) -> Starlette:
    access = switchboard.access

    def forbidden(request: Request) -> Response | None:
        return refusal(access, request)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "sessions": len(switchboard.sessions),
                             "slots": switchboard.capacity, "taken": switchboard.seats})

    async def voices(request: Request) -> Response:
        refusal = forbidden(request)
        if refusal is not None:
            return refusal
        return JSONResponse({"voices": switchboard.voices(),
                             "default_voice": switchboard.defaults.voice,
                             "default_role": switchboard.defaults.role})

    async def metrics(request: Request) -> Response:
        refusal = forbidden(request)
        if refusal is not None:
            return refusal
        return Response(switchboard.metrics(), media_type=METRICS_TYPE)

    async def reply(request: Request) -> Response:
        refusal = forbidden(request)
        if refusal is not None:
            return refusal
        client = request.client
        wants_json = "application/json" in request.headers.get("accept", "")
        answer = await switchboard.reply(_body(request), request.query_params,
                                         len(request.url.query.encode()), request.headers,
                                         client.host if client else "unknown", wants_json,
                                         _client_gone(request))
        return Response(answer.body, answer.status, media_type=answer.content_type)

    async def chat_completions(request: Request) -> Response:
        from .chat import error_body

        refusal = openai_refusal(access, request)
        if refusal is not None:
            return refusal
        client = request.client
        try:
            answer = await switchboard.chat(_body(request), request.query_params,
                                            request.headers,
                                            client.host if client else "unknown",
                                            _client_gone(request))
        except Exception as error:  # noqa: BLE001 - a bug: said in the log and in the answer
            switchboard.log(f"internal error answering /v1/chat/completions: "
                            f"{type(error).__name__}: {ascii(str(error))[:200]}")
            return Response(error_body(500, "internal error: the server could not answer "
                                       "this request (its log says why)"), 500,
                            media_type="application/json")
        if isinstance(answer.body, bytes):
            return Response(answer.body, answer.status, media_type=answer.content_type)
        return _Stream(answer)

    async def models(request: Request) -> Response:
        refusal = openai_refusal(access, request)
        if refusal is not None:
            return refusal
        return JSONResponse(model_list(int(switchboard.started_at)))

    routes = [
        WebSocketRoute("/api/chat", chat_endpoint(switchboard)),
        WebSocketRoute("/v1/realtime", realtime_endpoint(switchboard)),
        Route("/api/reply", reply, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/api/voices", voices),
        Route("/api/health", health),
        Route("/metrics", metrics),
        Mount("/", StaticFiles(directory=static_dir or PAGE_DIR, html=True)),
    ]
    middleware = [Middleware(HostCheck, access=access, counts=switchboard.counts,
                             debug=switchboard.debug),
                  Middleware(TokenCookie, access=access)]
    if access.allow_origins:
        middleware.insert(1, Middleware(
            CORSMiddleware, allow_origins=list(access.allow_origins),
            allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"],
            allow_credentials="*" not in access.allow_origins))
    return Starlette(routes=routes, middleware=middleware)


MISDIRECTED = ("this server does not answer to that Host name (a page of another site "
               "whose name points here?); see --allow-host")


class HostCheck:
    """Before anything else, on every route and the WebSocket: a request whose Host does not
    name this server gets 421 (DNS rebinding: serve/access.py). `counts` counts them (the
    server's /metrics), `debug` says so in the log (-v)."""

    def __init__(self, app, access, counts, debug=None):
        self.app = app
        self.access, self.counts, self.debug = access, counts, debug

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {key.decode("latin-1").lower(): value.decode("latin-1")
                   for key, value in scope["headers"]}
        if self.access.host_allowed(headers):
            return await self.app(scope, receive, send)
        self.counts["refused:host"] += 1
        if self.debug is not None:
            self.debug(f"refused a request for Host {ascii(headers.get('host'))}")
        response = PlainTextResponse(MISDIRECTED + "\n", 421)
        if scope["type"] == "websocket":
            await WebSocket(scope, receive, send).send_denial_response(response)
        else:
            await response(scope, receive, send)


class TokenCookie:
    """A page opened with a valid ?token=TOKEN gets the token as a cookie, so its WebSocket
    and API requests to this server carry it (NVIDIA's page, served by --static, knows
    nothing of tokens)."""

    def __init__(self, app, access):
        self.app = app
        self.access = access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.access.token is None:
            return await self.app(scope, receive, send)
        request = Request(scope)
        token = request.query_params.get("token")
        if token is None or not self.access.authorised({"token": token}, {}):
            return await self.app(scope, receive, send)
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict{secure}"

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"set-cookie", cookie.encode("latin-1"))]
            await send(message)

        return await self.app(scope, receive, send_with_cookie)
