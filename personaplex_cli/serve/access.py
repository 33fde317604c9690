"""Who may use the server: the token, the browser's origin, connections per address.

The token (`--token`) is checked on the WebSocket and every API route; the page itself and
`/api/health` need none. A client gives it as `?token=`, as `Authorization: Bearer TOKEN`,
or through the cookie that opening any page with `?token=TOKEN` sets, which is how a
browser page served here (ours, or NVIDIA's with `--static`) carries it on its WebSocket.

A browser says where a page came from in `Origin`. A request from a page of another origin
is refused unless `--allow-origin` names that origin (or `*`); clients that are not
browsers send no Origin and are not concerned.

A browser also names the server it thinks it talks to in `Host`. A page of evil.example
whose name is made to resolve to 127.0.0.1 (DNS rebinding) is same-origin with itself, so
the origin check lets it through; its Host still says evil.example. So every request and
WebSocket is refused (421) unless its Host names this server: localhost, a loopback
address, the address it listens on (any address of the machine when that is 0.0.0.0 or
::), or a name `--allow-host` gives (a reverse proxy's).
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import urlsplit

COOKIE = "personaplex_token"
LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")
WILDCARDS = ("0.0.0.0", "::", "")
# What a token may hold: it travels in a header, a cookie and a query string unchanged.
# What a Host header may be: a name or an IPv4 address, or an IPv6 address in brackets,
# each with a port or not, or a bare IPv6 address. Anything else
# (`127.0.0.1:80@evil.example`) names no server, whatever it starts with.
HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?|[0-9A-Fa-f:.]+")
TOKEN_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                             "0123456789-._~+/=")


def is_local(host: str) -> bool:
    return host in LOCAL_HOSTS or host.startswith("127.")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(header: str) -> str:
    """A Host header -> the name or address alone (no port, no brackets, lower case)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".")


def token_problem(token: str) -> str | None:
    """Why `token` cannot be used (it must pass through headers and cookies as it is)."""
    if not token:
        return "the token is empty"
    odd = sorted({c for c in token if c not in TOKEN_CHARACTERS})
    if odd:
        shown = "".join(odd)
        return (f"the token holds {ascii(shown)}: use letters, digits and -._~+/= only "
                "(it travels in a header, a cookie and a URL)")
    return None


@dataclass(frozen=True)
class Hosts:
    """The names a request's Host may give: this server's, and those --allow-host adds
    ('*': any)."""

    names: frozenset[str]
    any_address: bool = False  # listening on every address: any IP literal names us

    @classmethod
    def serving(cls, bound: str, allowed: tuple[str, ...] = ()) -> Hosts:
        bound = host_name(bound) if bound not in WILDCARDS else bound
        names = {"localhost", "127.0.0.1", "::1", bound} | {host_name(n) for n in allowed}
        if bound in WILDCARDS:
            import socket

            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        return cls(frozenset(names - {""}), bound in WILDCARDS)

    def allowed(self, header: str | None) -> bool:
        if "*" in self.names:
            return True
        if not header or not HOST_HEADER.fullmatch(header.strip()):
            return False
        name = host_name(header)
        return (name in self.names or name.startswith("127.") and _is_address(name)
                or self.any_address and _is_address(name))


def _cookies(header: str) -> dict[str, str]:
    from http.cookies import SimpleCookie

    jar = SimpleCookie()
    try:
        jar.load(header)
    except Exception:  # noqa: BLE001 - a malformed cookie header is no token
        return {}
    return {key: morsel.value for key, morsel in jar.items()}


@dataclass
class Access:
    token: str | None  # None: no token asked for
    allow_origins: tuple[str, ...] = ()
    max_per_client: int = 0  # 0: no limit
    hosts: Hosts | None = None  # None: Host is not checked (a host that checks it itself)
    _connections: Counter = field(default_factory=Counter)

    def token_given(self, query: Mapping[str, str], headers: Mapping[str, str]) -> str | None:
        if "token" in query:
            return query["token"]
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return _cookies(headers.get("cookie", "")).get(COOKIE)

    def authorised(self, query: Mapping[str, str], headers: Mapping[str, str]) -> bool:
        if self.token is None:
            return True
        given = self.token_given(query, headers)
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def host_allowed(self, headers: Mapping[str, str]) -> bool:
        return self.hosts is None or self.hosts.allowed(headers.get("host"))

    def origin_allowed(self, headers: Mapping[str, str]) -> bool:
        """Same origin (the Origin's host:port is the Host the request went to), no Origin
        at all, or an origin --allow-origin names."""
        origin = headers.get("origin")
        if origin is None:
            return True
        if "*" in self.allow_origins or origin in self.allow_origins:
            return True
        return urlsplit(origin).netloc.lower() == headers.get("host", "").lower()

    def cors_origin(self, headers: Mapping[str, str]) -> str | None:
        """The Access-Control-Allow-Origin value for a cross-origin request allowed here."""
        origin = headers.get("origin")
        if origin is not None and ("*" in self.allow_origins or origin in self.allow_origins):
            return origin
        return None

    # -- connections per client address ---------------------------------------------------

    def connect(self, address: str) -> bool:
        """Counts a connection from `address`; False (and not counted) when over the limit."""
        if self.max_per_client and self._connections[address] >= self.max_per_client:
            return False
        self._connections[address] += 1
        return True

    def disconnect(self, address: str) -> None:
        self._connections[address] -= 1
        if self._connections[address] <= 0:
            del self._connections[address]
