"""`personaplex serve`: many callers at once over NVIDIA's WebSocket protocol, a web page.

parse (access rule, TLS files, the port) -> open (model, default persona, slots, warm-up:
serve/server.py) -> call (serve until SIGINT/SIGTERM) -> report (a summary; 130/143).
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Annotated

import typer

from ..core.config import Sampling
from ..prompts.voices import DEFAULT_VOICE
from ..serve.protocol import DEFAULT_PORT
from .options import (DEFAULT_MODEL, AudioTemperatureOpt, AudioTopKOpt, DeviceOpt, DtypeOpt,
                      COMPILE_DEFAULT, CompileOpt, Graphs, GraphsOpt, GreedyOpt, ModelOpt,
                      PromptFileOpt, PromptOpt, Quantize, QuantizeOpt, RayOpt, QuietOpt, SeedOpt,
                      TemperatureOpt, TopKOpt, VerboseOpt, VoiceOpt, graphs_choice, number_in,
                      role_text)
from .options import MAX_PRIME_S, MaxPrimeOpt
from .output import Output

_ORIGIN_RE = re.compile(r"^(\*|https?://[^/\s]+)$")
_HOST_RE = re.compile(r"^(\*|[A-Za-z0-9_.-]+|\[?[0-9A-Fa-f:.]+\]?)$")


def serve(
    host: Annotated[str, typer.Option(
        "--host", metavar="ADDRESS",
        help="Address to listen on; anything but this machine's loopback needs --token "
        "or --no-auth.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", metavar="PORT", callback=number_in(0, 65535),
        help="Port to listen on, 0 to 65535 (0: any free one).")
    ] = DEFAULT_PORT,
    max_sessions: Annotated[int | None, typer.Option(
        "--max-sessions", min=1, max=1024, metavar="N",
        help="Conversations at once, each in its own slot of the batch (default: the "
        "fewer of what fits the device's memory and what the warm-up steps in real "
        "time). One more is refused at once.")] = None,
    idle_timeout: Annotated[float, typer.Option(
        "--idle-timeout", metavar="SECONDS", callback=number_in(1),
        help="Close a session that sends no audio, or reads none, for this long, and cut "
        "an HTTP answer its client stops reading (1 s or more).")] = 60.0,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="PERSONAPLEX_TOKEN", metavar="TOKEN",
        help="Require this token on the WebSocket and the API (?token=, a Bearer header, "
        "or the cookie a page opened with ?token= gets).")] = None,
    no_auth: Annotated[bool, typer.Option(
        "--no-auth", help="Serve another --host without a token: anyone who reaches the "
        "port can talk to the model.")] = False,
    ssl_cert: Annotated[str | None, typer.Option(
        "--ssl-cert", metavar="FILE", help="TLS certificate (PEM): serve https and wss.")
    ] = None,
    ssl_key: Annotated[str | None, typer.Option(
        "--ssl-key", metavar="FILE", help="The certificate's private key (PEM).")] = None,
    allow_origin: Annotated[list[str] | None, typer.Option(
        "--allow-origin", metavar="ORIGIN",
        help="Let pages from this origin (https://host:port, or *) use the server; other "
        "cross-origin browsers are refused. Repeatable.")] = None,
    allow_host: Annotated[list[str] | None, typer.Option(
        "--allow-host", metavar="NAME",
        help="Also answer requests for this Host name (a reverse proxy's; * for any). "
        "Others than localhost, loopback addresses and --host get 421. Repeatable.")
    ] = None,
    static: Annotated[str | None, typer.Option(
        "--static", metavar="DIR",
        help="Serve this folder at / instead of our page (e.g. NVIDIA's client, built).")
    ] = None,
    max_per_client: Annotated[int, typer.Option(
        "--max-per-client", min=0, metavar="N",
        help="Connections at once from one client address (0: no limit).")] = 4,
    ray_address: RayOpt = None,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", min=1, max=4096, metavar="N",
        help="With --ray: N engine replicas (default: one per GPU of the cluster, or one "
        "on CPUs), each with --max-sessions slots.")] = None,
    voice: VoiceOpt = DEFAULT_VOICE,
    prompt: PromptOpt = None,
    prompt_file: PromptFileOpt = None,
    temperature: TemperatureOpt = Sampling.temp_text,
    top_k: TopKOpt = Sampling.top_k_text,
    audio_temperature: AudioTemperatureOpt = Sampling.temp_audio,
    audio_top_k: AudioTopKOpt = Sampling.top_k_audio,
    greedy: GreedyOpt = False,
    seed: SeedOpt = None,
    max_prime_s: MaxPrimeOpt = MAX_PRIME_S,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = Quantize.none,
    graphs: GraphsOpt = Graphs.auto,
    compile_mode: CompileOpt = COMPILE_DEFAULT,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Serve the model to many callers at once: NVIDIA's WebSocket protocol, OpenAI's
    Realtime and audio chat APIs, and a web page.

    Open http://HOST:PORT/ in a browser, or point NVIDIA's web client or Kyutai's
    `moshi.client` at ws://HOST:PORT/api/chat, or an OpenAI client (base URL
    http://HOST:PORT/v1) at /v1/realtime (a WebSocket of JSON events),
    /v1/chat/completions and /v1/models. Each caller takes a slot of one batch on the
    device, with the persona and sampling of its query (the options here are the
    defaults). POST /api/reply answers a recording in its body (any format reply reads;
    /api/chat's query, plus tail_silence) with the reply as WAV, or as JSON with Accept:
    application/json. /metrics, /api/health and /api/voices tell how it goes. One line per
    session start and end on stderr. Ctrl-C or SIGTERM closes every session with a
    message, then exits 130 or 143.
    """
    out = Output(quiet, verbose)
    _check_host(host)
    _check_access(host, token, no_auth)
    _check_tls(ssl_cert, ssl_key)
    origins = tuple(allow_origin or ())
    for origin in origins:
        if not _ORIGIN_RE.match(origin):
            raise typer.BadParameter(f"{origin!r} is not an origin like https://host:port "
                                     "(or *)", param_hint="'--allow-origin'")
    hosts = tuple(allow_host or ())
    for name in hosts:
        if not _HOST_RE.match(name):
            raise typer.BadParameter(f"{name!r} is not a host name (like proxy.example.org, "
                                     "an address, or *)", param_hint="'--allow-host'")
    static_dir = _static_dir(static)
    role = role_text(prompt, prompt_file)
    if ray_address is None and replicas is not None:
        raise typer.BadParameter("--replicas sizes a --ray deployment: give --ray too",
                                 param_hint="'--replicas'")
    if ray_address is not None:
        for given, name in ((ssl_cert, "--ssl-cert"), (static, "--static")):
            if given is not None:
                raise typer.BadParameter(f"{name} is not taken with --ray (Serve's proxy "
                                         "serves plain http and our page)",
                                         param_hint=f"'{name}'")
        from ..cluster.ray_cluster import LOCAL, import_ray

        import_ray(ray_address)  # without the extra, stop before anything loads
        if ray_address == LOCAL and port:  # Serve's proxy will listen here, on this machine
            _listen(host, port).close()
    else:
        _listen(host, port).close()  # refused now if taken, not after the model has loaded

    from ..serve.access import Access, Hosts
    from ..serve.query import Defaults
    from ..serve.server import Server

    defaults = Defaults(voice=voice, role=role, temp_text=temperature, top_k_text=top_k,
                        temp_audio=audio_temperature, top_k_audio=audio_top_k,
                        greedy=greedy, seed=seed)
    if ray_address is not None:
        return _serve_on_ray(out, ray_address, replicas, host=host, port=port, model=model,
                             device=device, dtype=dtype.value if dtype else None,
                             quantize=quantize.value, defaults=defaults, token=token,
                             allow_origins=origins, max_per_client=max_per_client,
                             max_sessions=max_sessions, idle_timeout=idle_timeout,
                             hosts=Hosts.serving(host, hosts), max_prime_s=max_prime_s,
                             graphs=graphs_choice(graphs))
    access = Access(token, origins, max_per_client, Hosts.serving(host, hosts))
    server = Server.open(model, device, dtype.value if dtype else None, defaults, access,
                         max_sessions=max_sessions, idle_timeout=idle_timeout,
                         static_dir=static_dir, log=out.note, debug=out.info,
                         quantize=quantize.value, max_prime_s=max_prime_s,
                         graphs=graphs_choice(graphs), warn=out.warn,
                         compile_mode=compile_mode.value)
    out.note(server.capacity.line())
    if server.capacity.warning():
        out.warn(server.capacity.warning())
    sock = _listen(host, port)
    bound = sock.getsockname()[1]
    scheme = "https" if ssl_cert else "http"
    shown = f"[{host}]" if ":" in host else host

    capacity = server.switchboard.capacity

    def ready(stop) -> None:
        out.note(f"listening on {scheme}://{shown}:{bound}/ (WebSockets /api/chat and "
                 "/v1/realtime), "
                 f"{capacity} session{'s' if capacity > 1 else ''} "
                 f"at most ({server.capacity.bound}); {_access_line(host, token)}")

    signum = server.run(sock, ssl_cert=ssl_cert, ssl_key=ssl_key, on_ready=ready)
    out.note(server.switchboard.summary())
    if server.switchboard.failure is not None:
        raise server.switchboard.failure
    if signum is not None:  # a stop asked for and done: the summary said it all
        raise typer.Exit(128 + signum)


def _serve_on_ray(out: Output, address: str, replicas: int | None, *, host: str, port: int,
                  model: str, device: str, **options) -> None:
    """Deploys the engines and the ingress on the cluster; serves until SIGINT or SIGTERM,
    then takes them down (and Serve, when this command started it)."""
    import time

    from ..cluster.ray_cluster import connect, plan_pool
    from ..cluster.serving import deploy

    from ..cluster.serving import is_engine

    ray = connect(address, verbose=out.verbose, worker_logs=None if out.quiet else is_engine)
    try:
        pool = plan_pool(ray, device, replicas)
        out.info(f"deploying {pool.workers} replica(s) on {'GPUs' if pool.gpus else 'CPUs'}")
        if port == 0:  # Serve's proxy takes a port number: a free one of this machine
            with _listen(host, 0) as probe:
                port = probe.getsockname()[1]
        deployment = deploy(pool, host=host, port=port, model=model, device=device, **options)
        try:
            health = deployment.wait_ready()
            shown = f"[{host}]" if ":" in host else host
            out.note(f"listening on http://{shown}:{port}/ (WebSocket /api/chat), "
                     f"{health['slots']} session{'s' if health['slots'] > 1 else ''} at most "
                     f"over {len(health['replicas'])} replica(s) on Ray; "
                     f"{_access_line(host, options['token'])}")
            while True:  # until a signal: the CLI's handler raises Interrupted here
                time.sleep(1.0)
        finally:
            deployment.close()
    finally:
        ray.shutdown()


def _check_host(host: str) -> None:
    """--host is an IP address, or a name this machine resolves (before --token is asked
    for: `999.1.1.1` is no address at all, not one that other machines reach)."""
    import ipaddress
    import socket

    if not host:
        raise typer.BadParameter("the address is empty (127.0.0.1: this machine only)",
                                 param_hint="'--host'")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return
    except ValueError:
        pass
    if host.replace(".", "").isdigit() or ":" in host:
        raise typer.BadParameter(f"{host} is not a valid IP address", param_hint="'--host'")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise typer.BadParameter(f"{host} is not an address or a name this machine resolves",
                                 param_hint="'--host'") from None


def _check_access(host: str, token: str | None, no_auth: bool) -> None:
    from ..serve.access import is_local

    if token is not None and no_auth:
        raise typer.BadParameter("give --token or --no-auth, not both", param_hint="'--no-auth'")
    from ..serve.access import token_problem

    problem = None if token is None else token_problem(token)
    if problem:
        raise typer.BadParameter(problem, param_hint="'--token'")
    if not is_local(host) and token is None and not no_auth:
        raise typer.BadParameter(f"{host} is reachable from other machines: give --token "
                                 "TOKEN (or --no-auth to let anyone in)", param_hint="'--host'")


def _access_line(host: str, token: str | None) -> str:
    from ..serve.access import is_local

    if token is not None:
        return "a token is required"
    if is_local(host):
        return "no token: any user of this machine can connect"
    return "no token (--no-auth): anyone who reaches the port can connect"


def _check_tls(cert: str | None, key: str | None) -> None:
    if (cert is None) != (key is None):
        raise typer.BadParameter("TLS needs both --ssl-cert and --ssl-key",
                                 param_hint="'--ssl-key'" if key is None else "'--ssl-cert'")
    if cert is None:
        return
    import ssl

    from ..errors import InputError

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as error:
        reason = getattr(error, "strerror", None) or getattr(error, "reason", None) or error
        raise InputError(f"cannot use the certificate {cert} with the key {key}: "
                         f"{reason}") from None


def _static_dir(static: str | None) -> Path | None:
    if static is None:
        return None
    path = Path(static).expanduser()
    if not path.is_dir():
        raise typer.BadParameter(f"{static} is not a directory", param_hint="'--static'")
    if not (path / "index.html").is_file():
        raise typer.BadParameter(f"{static} has no index.html", param_hint="'--static'")
    return path


def _listen(host: str, port: int):
    from ..serve.runner import bind

    try:
        return bind(host, port)
    except OSError as error:
        reason = error.strerror or str(error)
        raise typer.BadParameter(f"cannot listen on {host}:{port}: {reason}",
                                 param_hint="'--port'" if error.errno == errno.EADDRINUSE else "'--host'"
                                 ) from None
