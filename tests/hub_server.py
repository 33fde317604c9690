"""A small local stand-in for the Hugging Face hub, for download tests.

It serves what huggingface_hub 2.4's `hf_hub_download` and `HfApi.model_info` ask for:

  GET  /api/models/{owner}/{name}[/revision/{rev}][?blobs=true]   repo info: sha, siblings
  HEAD /{owner}/{name}/resolve/{rev}/{file}                       file metadata
  GET  /{owner}/{name}/resolve/{rev}/{file}                       (same answer, plus the body)
  GET  /cdn/{sha256}     (on a second port, standing in for the CDN)   LFS file bodies

A HEAD on `resolve` carries `X-Repo-Commit` and, for a plain git file, `ETag` (the git blob
id) and `Content-Length`; for an LFS file it is a 302 to the "CDN" port with `X-Linked-Etag`
(the sha256), `X-Linked-Size` and `Location`, as the real hub does. Bodies honour `Range`
(206 + `Content-Range`). The CDN is on another port, so the client treats it as a foreign
host and drops the `Authorization` header there, as it does for the real CDN.

Errors use the headers huggingface_hub maps to its exception classes: `X-Error-Code:
GatedRepo` (401 without a token, 403 with a token not on the list), `RepoNotFound`,
`RevisionNotFound`, `EntryNotFound`, and a 401 with `X-Error-Message: Invalid credentials in
Authorization header` for a token the hub does not know.

Test hooks: `cut_after(file, n)` closes the connection after n body bytes (once by default),
`stall_after(file, n)` sends n body bytes then waits until `release()`, `on_body` is called
before a body is sent, `stall_api` makes the repo-info endpoint hang, and `corrupt` (a set
of file names) flips the first byte of those bodies, headers unchanged. Every request is
recorded in `requests` (method, path, Range, token, port role, status) and body bytes are
counted in `bytes_served`.

Binds to 127.0.0.1 only, on free ports chosen by the OS.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import tarfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".model", ".tgz", ".pt", ".bin")
CHUNK = 64 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class RepoFile:
    name: str
    data: bytes
    lfs: bool

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
                f"size {self.size}\n").encode()

    @property
    def blob_id(self) -> str:
        return git_blob_id(self.pointer if self.lfs else self.data)

    @property
    def etag(self) -> str:
        """What huggingface_hub will name the blob in its cache."""
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, RepoFile]
    commit: str
    branches: dict[str, str]
    gated: bool = False
    authorized_tokens: set[str] = field(default_factory=set)
    # Tokens the hub does not know at all: 401 "Invalid credentials" everywhere.
    rejected_tokens: set[str] = field(default_factory=set)

    def resolve_revision(self, rev: str) -> str | None:
        if rev == self.commit:
            return rev
        return self.branches.get(rev)


@dataclass
class Request:
    role: str  # "hub" or "cdn"
    method: str
    path: str  # unquoted, without the query string
    query: str
    range: str | None
    token: str | None
    status: int = 0

    @property
    def file(self) -> str | None:
        """The file a resolve request names (None for other requests)."""
        parts = self.path.strip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            return "/".join(parts[4:])
        return None


@dataclass
class _BodyRule:
    after: int
    times: int
    stall: threading.Event | None = None


class HubServer:
    """`with HubServer() as hub: hub.add_repo(...); env HF_ENDPOINT=hub.url`."""

    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.bytes_served: dict[str, int] = {}  # file name -> body bytes sent
        self.on_body = None  # callable(repo_id, file_name) run before a body is sent
        self.stall_api = False
        self.corrupt = set()  # file names whose body is served with one byte flipped
        self._rules: dict[str, _BodyRule] = {}
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._stalled = threading.Event()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self.url = ""
        self.cdn_url = ""

    # -- set-up -------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes | Path], *, gated: bool = False,
                 authorized_tokens=(), rejected_tokens=(), lfs: set[str] | None = None,
                 branches=("main",)) -> FakeRepo:
        entries = {}
        for name, content in files.items():
            data = content.read_bytes() if isinstance(content, Path) else bytes(content)
            is_lfs = name in lfs if lfs is not None else name.endswith(LFS_SUFFIXES)
            entries[name] = RepoFile(name, data, is_lfs)
        digest = hashlib.sha1(repo_id.encode())
        for name in sorted(entries):
            digest.update(name.encode() + b"\0" + entries[name].sha256.encode())
        commit = digest.hexdigest()
        repo = FakeRepo(repo_id, entries, commit, {b: commit for b in branches}, gated,
                        set(authorized_tokens), set(rejected_tokens))
        self.repos[repo_id] = repo
        return repo

    def cut_after(self, file_name: str, nbytes: int, times: int = 1) -> None:
        """Close the connection after `nbytes` of the body of `file_name`, `times` times."""
        self._rules[file_name] = _BodyRule(nbytes, times)

    def stall_after(self, file_name: str, nbytes: int) -> None:
        """Send `nbytes` of `file_name`'s body, then hang until `release()` (once)."""
        self._release.clear()
        self._stalled.clear()
        self._rules[file_name] = _BodyRule(nbytes, 1, self._release)

    def wait_stalled(self, timeout: float = 30) -> bool:
        return self._stalled.wait(timeout)

    def release(self) -> None:
        self._release.set()

    def clear_log(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_served.clear()

    # -- queries for tests -----------------------------------------------------------------
    def body_gets(self) -> list[Request]:
        """GET requests that returned (part of) a file body."""
        return [r for r in self.requests if r.method == "GET" and r.status in (200, 206)
                and (r.role == "cdn" or r.file is not None)]

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "HubServer":
        for role in ("hub", "cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self, role))
            server.daemon_threads = True
            thread = threading.Thread(target=server.serve_forever, name=f"hub-{role}",
                                      kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        self.url = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self._servers[1].server_address[1]}"
        return self

    def stop(self) -> None:
        self._release.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- internals used by the handler -------------------------------------------------------
    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _take_rule(self, file_name: str) -> _BodyRule | None:
        with self._lock:
            rule = self._rules.get(file_name)
            if rule is None or rule.times <= 0:
                return None
            rule.times -= 1
            return rule

    def _count(self, file_name: str, n: int) -> None:
        with self._lock:
            self.bytes_served[file_name] = self.bytes_served.get(file_name, 0) + n


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _make_handler(hub: HubServer, role: str):
    class Handler(_Handler):
        pass

    Handler.hub = hub
    Handler.role = role
    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer
    role: str

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    # -- dispatch --------------------------------------------------------------------------
    def _handle(self, head: bool) -> None:
        split = urlsplit(self.path)
        path = unquote(split.path)
        auth = self.headers.get("Authorization")
        token = auth[len("Bearer "):] if auth and auth.startswith("Bearer ") else None
        self.record = Request(self.role, self.command, path, split.query,
                              self.headers.get("Range"), token)
        self.hub._record(self.record)
        try:
            if self.role == "cdn":
                self._cdn(split.path, head)
            elif split.path.startswith("/api/models/"):
                self._api(split, token)
            else:
                self._resolve(split.path, head, token)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _api(self, split, token) -> None:
        if self.hub.stall_api:
            self.hub._release.wait(60)
            self.close_connection = True
            return
        parts = [unquote(p) for p in split.path[len("/api/models/"):].split("/")]
        if len(parts) < 2:
            return self._error(404, "RepoNotFound", "Repository not found")
        repo = self._repo("/".join(parts[:2]), token)
        if repo is None:
            return
        rev = "main"
        if len(parts) >= 4 and parts[2] == "revision":
            rev = "/".join(parts[3:])
        commit = repo.resolve_revision(rev)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        blobs = parse_qs(split.query).get("blobs", [""])[0].lower() == "true"
        siblings = []
        for f in repo.files.values():
            entry = {"rfilename": f.name}
            if blobs:
                entry.update(size=f.size, blobId=f.blob_id)
                if f.lfs:
                    entry["lfs"] = {"size": f.size, "sha256": f.sha256,
                                    "pointerSize": len(f.pointer)}
            siblings.append(entry)
        body = {"_id": commit[:24], "id": repo.repo_id, "modelId": repo.repo_id,
                "author": repo.repo_id.split("/")[0], "sha": commit, "private": False,
                "gated": "manual" if repo.gated else False, "disabled": False,
                "lastModified": "2026-01-15T00:00:00.000Z", "tags": [], "siblings": siblings}
        self._json(200, body)

    def _resolve(self, raw_path: str, head: bool, token) -> None:
        parts = [unquote(p) for p in raw_path.strip("/").split("/")]
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(404, None, "Not found")
        repo = self._repo("/".join(parts[:2]), token)
        if repo is None:
            return
        if repo.gated and token not in repo.authorized_tokens:
            if token is None:
                return self._error(
                    401, "GatedRepo",
                    f"Access to model {repo.repo_id} is restricted. You must have access to it "
                    "and be authenticated to access it. Please log in.")
            return self._error(
                403, "GatedRepo",
                f"Access to model {repo.repo_id} is restricted and you are not in the "
                f"authorized list. Visit https://huggingface.co/{repo.repo_id} to ask for access.")
        commit = repo.resolve_revision(parts[3])
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[3]}")
        name = "/".join(parts[4:])
        f = repo.files.get(name)
        if f is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist",
                               {"X-Repo-Commit": commit})
        common = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if f.lfs:
            location = f"{self.hub.cdn_url}/cdn/{f.sha256}?name={quote(name)}"
            headers = {**common, "ETag": f'"{f.blob_id}"', "X-Linked-Etag": f'"{f.sha256}"',
                       "X-Linked-Size": str(f.size), "Location": location,
                       "Content-Length": "0"}
            self.record.status = 302
            self.send_response(302)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            return
        self._body(repo.repo_id, f, head, {**common, "ETag": f'"{f.blob_id}"'})

    def _cdn(self, raw_path: str, head: bool) -> None:
        sha = raw_path.rsplit("/", 1)[-1]
        for repo in self.hub.repos.values():
            for f in repo.files.values():
                if f.lfs and f.sha256 == sha:
                    return self._body(repo.repo_id, f, head, {"ETag": f'"{sha}"'})
        self._error(404, None, "No such object")

    # -- bodies ----------------------------------------------------------------------------
    def _body(self, repo_id: str, f: RepoFile, head: bool, headers: dict) -> None:
        start, end = 0, f.size - 1
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            parsed = _parse_range(wanted, f.size)
            if parsed is None:
                self.record.status = 416
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{f.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, end = parsed
            status = 206
        length = max(end - start + 1, 0)
        self.record.status = status
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        self.end_headers()
        if head:
            return
        if self.hub.on_body is not None:
            self.hub.on_body(repo_id, f.name)
        rule = self.hub._take_rule(f.name)
        limit = length if rule is None else min(rule.after, length)
        data = f.data
        if f.name in self.hub.corrupt and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        sent = 0
        while sent < limit:
            piece = data[start + sent:start + min(sent + CHUNK, limit)]
            self.wfile.write(piece)
            sent += len(piece)
            self.hub._count(f.name, len(piece))
        self.wfile.flush()
        if rule is not None and limit < length:
            if rule.stall is not None:
                self.hub._stalled.set()
                rule.stall.wait(60)
            # Drop the connection in the middle of the body.
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- errors ----------------------------------------------------------------------------
    def _repo(self, repo_id: str, token):
        """The repo, or None once the hub's answer for an unknown repo or a rejected token
        has been sent (an unknown repo looks like a private one to an anonymous client)."""
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(401 if token is None else 404, "RepoNotFound", "Repository not found")
        elif token is not None and token in repo.rejected_tokens:
            self._bad_token()
            return None
        return repo

    def _error(self, status: int, code: str | None, message: str, extra: dict | None = None):
        headers = dict(extra or {})
        if code:
            headers["X-Error-Code"] = code
        headers["X-Error-Message"] = message
        self._json(status, {"error": message}, headers)

    def _bad_token(self):
        self._error(401, None, "Invalid credentials in Authorization header")

    def _json(self, status: int, body, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.record.status = status
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
    """`bytes=a-`, `bytes=a-b` or `bytes=-n` -> (first, last), None if unsatisfiable."""
    if not value.startswith("bytes=") or "," in value:
        return None
    first, _, last = value[len("bytes="):].strip().partition("-")
    try:
        if first == "":
            n = int(last)
            return (max(size - n, 0), size - 1) if n > 0 and size > 0 else None
        a = int(first)
        b = int(last) if last else size - 1
    except ValueError:
        return None
    if a >= size or b < a:
        return None
    return a, min(b, size - 1)


def wait_until(predicate, timeout: float = 30, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def tgz(entries) -> bytes:
    """entries: (name, bytes) for a file, (name, None) for a folder, or a TarInfo as is."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                tar.addfile(entry, io.BytesIO(b"x" * entry.size) if entry.isreg() else None)
                continue
            name, data = entry
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
