"""Who may use the server: the token, the browser's origin, connections per address.

The token (`--token`) is checked on the WebSocket and every API route; the page itself and
`/api/health` need none. A client gives it as `?token=`, as `Authorization: Bearer TOKEN`,
or through the cookie that opening any page with `?token=TOKEN` sets, which is how a
browser page served here (ours, or NVIDIA's with `--static`) carries it on its WebSocket.

A browser says where a page came from in `Origin`. A request from a page of another origin
is refused unless `--allow-origin` names that origin (or `*`); clients that are not
browsers send no Origin and are not concerned.
"""

from __future__ import annotations

import hmac
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import urlsplit

COOKIE = "personaplex_token"
LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")


def is_local(host: str) -> bool:
    return host in LOCAL_HOSTS or host.startswith("127.")


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
