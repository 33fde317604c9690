"""Fetching PersonaPlex from the Hugging Face hub into the hub's own cache.

`download()` fetches exactly the files the tool uses (`HUB_FILES`: the LM, Mimi, the text
tokenizer and voices.tgz, and personaplex-arch.json where a repo has one; not dist.tgz or
config.json) into huggingface_hub's cache
(`$HF_HUB_CACHE`, default `$HF_HOME/hub`), then unpacks voices.tgz into `voices/` beside it
in the snapshot folder, as NVIDIA's code does. `cached_snapshot()` finds a downloaded model
with no network access at all; the other commands use it through `files.resolve_model`.

huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and
HF_HUB_DISABLE_PROGRESS_BARS when it is imported, and HF_TOKEN (or the token stored by
`hf auth login`) when a request is made; nothing here sets or caches any of them, and a
`token` argument overrides the environment for one call.

How a download goes:
  1. one API call resolves the revision to a commit and lists the files with their sizes
     (the real hub answers it without a token, even for a gated repo);
  2. files already in the snapshot are skipped: a second run makes that one call only, and
     none at all with a commit hash for `revision` or with HF_HUB_OFFLINE=1;
  3. the free space of the cache's disk is checked against what is still to fetch;
  4. each missing file: a HEAD (where access to a gated repo is checked), then the body
     with huggingface_hub's own `http_get` into `blobs/<etag>.incomplete`, which is kept
     when the transfer stops (network loss, Ctrl-C, kill, full disk) and continued with an
     HTTP Range request by the next run; the sha256 of an LFS file is checked before it
     becomes the blob. `hf_hub_download` then links it into the snapshot and writes nothing
     else. (huggingface_hub 2.4 itself resumes only inside one process, from its last full
     10 MiB chunk, and deletes its partial file when it gives up: a new run starts over.)
     With `xet=True` a file the hub serves through Xet is left to huggingface_hub and
     hf_xet instead (faster on the real hub, but not resumed by this module);
  5. `refs/<revision>` is written once every file is there, then voices.tgz is unpacked.

Every failure ends in a `PersonaplexError` with a one-line message (see `errors.py`):
HubAccessError, HubNotFoundError, HubUnreachableError, DownloadError (exit 3),
ModelNotFoundError (exit 3, offline without the files), DiskFullError (exit 8),
UnsafeArchiveError / ModelInvalidError (exit 6, a bad voices.tgz).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

from ..errors import (
    DiskFullError,
    DownloadError,
    HubAccessError,
    HubNotFoundError,
    HubUnreachableError,
    ModelInvalidError,
    OutputError,
    PersonaplexError,
)
from .digest import sha256_file
from .files import (COMMIT_HASH, DEFAULT_MODEL, HUB_FILES, OPTIONAL_HUB_FILES, VOICES_ARCHIVE,
                    VOICES_DIR,
                    SHA256, ModelNotFoundError, cache_root, check_repo_id, damaged_in_cache,
                    existing_parent, licence_url, locate_snapshot, partial_blob, repo_folder)
from .voices_archive import extract_voices, format_size

_ROUNDS = 3  # transfers of one file per run, each continuing the last, while data flows


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    path: Path  # inside the snapshot folder (a link into the cache's blobs)
    fetched: bool  # whether this call transferred (some of) it


@dataclass(frozen=True)
class DownloadResult:
    repo: str
    revision: str  # the commit hash
    path: Path  # the snapshot folder: a model directory for `resolve_model`
    files: tuple[FileEntry, ...]
    voices: Path  # the unpacked voices folder, inside `path`

    def as_json(self) -> dict:
        return {
            "repo": self.repo, "revision": self.revision, "path": str(self.path),
            "files": [{"name": f.name, "size": f.size, "path": str(f.path)} for f in self.files],
        }


# -- download ------------------------------------------------------------------------------

def download(repo: str = DEFAULT_MODEL, *, revision: str | None = None,
             token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
             progress: bool = True, report: Callable[[str], None] | None = None,
             xet: bool = False, verify: bool = False) -> DownloadResult:
    """Fetches `HUB_FILES` of `repo` at `revision` into the hub cache, unpacks the voices.

    token: None = huggingface_hub's own choice (HF_TOKEN, else the `hf auth login` token);
      a string overrides it; False sends none.
    cache_dir: None = huggingface_hub's cache (HF_HUB_CACHE / HF_HOME).
    progress: False turns off the progress bars and huggingface_hub's warnings (quiet);
      True leaves huggingface_hub's bars on stderr, shown only when it is a terminal and
      HF_HUB_DISABLE_PROGRESS_BARS is not set.
    report: receives a few one-line status messages (resuming, checking, unpacking).
    xet: leave files the hub serves through Xet to huggingface_hub/hf_xet (see the module
      docstring); by default every file goes through the resumable HTTP transfer.
    verify: also check the files already in the cache against the sha256 the hub gives
      (each fetched file always is): a damaged one is fetched again, or offline, raised
      (ModelInvalidError, exit 6).
    """
    job = _Job(repo, revision, token, cache_root(cache_dir), progress,
               report or (lambda message: None), xet, verify)
    with _hub_logs(quiet=not progress):
        try:
            return job.run()
        except PersonaplexError:
            raise
        except Exception as error:
            mapped = job.translate(error)
            if mapped is None:
                raise
            raise mapped from error


class _Job:
    def __init__(self, repo, revision, token, cache: Path, progress: bool, say, xet: bool,
                 verify: bool = False):
        self.verify_cached = verify
        self.repo = repo
        self.revision = revision
        self.token = token
        self.cache = cache
        self.say = say
        self.xet = xet
        self.total: int | None = None  # bytes of all the files
        self.needed: int | None = None  # bytes still to fetch
        self.current: str | None = None  # the file being fetched
        self.tqdm_class = None if progress else _silent_tqdm_class()

    @property
    def rev_label(self) -> str:
        return self.revision or "main"

    # -- steps -------------------------------------------------------------------------
    def run(self) -> DownloadResult:
        from huggingface_hub import constants

        check_repo_id(self.repo)
        if constants.is_offline_mode():
            return self.from_cache_offline()
        if self.revision and COMMIT_HASH.fullmatch(self.revision):
            snapshot, missing = locate_snapshot(self.cache, self.repo, self.revision, HUB_FILES)
            if snapshot is not None and not missing and not self.verify_cached:
                return self.finish(snapshot, self.revision, set())
        return self.fetch()

    def from_cache_offline(self) -> DownloadResult:
        snapshot, missing = locate_snapshot(self.cache, self.repo, self.revision, HUB_FILES)
        if snapshot is None or missing:
            where = (str(self.cache) if snapshot is None
                     else f"{snapshot}, missing {', '.join(missing)}")
            raise ModelNotFoundError(
                f"HF_HUB_OFFLINE is set and model {self.repo} (revision {self.rev_label}) is "
                f"not completely in the local Hugging Face cache ({where}); unset "
                "HF_HUB_OFFLINE to download it, or pass --model DIR")
        if self.verify_cached:
            for name in HUB_FILES:
                damage = self.damage(snapshot / name, None)
                if damage:
                    raise ModelInvalidError(f"{damage}; unset HF_HUB_OFFLINE and run "
                                            "download --verify again to fetch it anew")
        return self.finish(snapshot, snapshot.name, set())

    def fetch(self) -> DownloadResult:
        from huggingface_hub import HfApi, constants

        api = HfApi(token=self.token)
        info = api.model_info(self.repo, revision=self.revision, files_metadata=True,
                              timeout=constants.HF_HUB_ETAG_TIMEOUT)
        commit = info.sha
        if not commit:
            raise DownloadError(f"the hub at {constants.ENDPOINT} gave no commit for "
                                f"{self.repo}; check HF_ENDPOINT")
        siblings = {s.rfilename: s for s in info.siblings or []}
        absent = [name for name in HUB_FILES if name not in siblings]
        if absent:
            raise HubNotFoundError(
                f"model repo {self.repo} (revision {self.rev_label}) has no "
                f"{', '.join(absent)}: it does not look like a PersonaPlex repo")
        wanted = HUB_FILES + tuple(name for name in OPTIONAL_HUB_FILES if name in siblings)
        sizes = {name: _sibling_size(siblings[name]) for name in wanted}
        storage = repo_folder(self.cache, self.repo)
        snapshot = storage / "snapshots" / commit
        todo = [name for name in wanted if not (snapshot / name).is_file()]
        if self.verify_cached:
            todo += self.drop_damaged(snapshot, siblings, wanted, todo)
        self.total = sum(size or 0 for size in sizes.values())
        self.needed = sum(self.still_needed(storage, siblings[name], sizes[name]) for name in todo)
        if todo:
            self.check_space(self.needed)
        for name in todo:
            self.current = name
            self.fetch_file(name, commit, storage)
        self.current = None
        self.write_ref(storage, commit)
        return self.finish(snapshot, commit, set(todo))

    def finish(self, snapshot: Path, commit: str, fetched: set[str]) -> DownloadResult:
        voices = extract_voices(snapshot / VOICES_ARCHIVE, snapshot / VOICES_DIR, report=self.say)
        present = HUB_FILES + tuple(n for n in OPTIONAL_HUB_FILES if (snapshot / n).is_file())
        files = tuple(FileEntry(name, (snapshot / name).stat().st_size, snapshot / name,
                                name in fetched) for name in present)
        return DownloadResult(self.repo, commit, snapshot, files, voices)

    # -- one file ----------------------------------------------------------------------
    def fetch_file(self, name: str, commit: str, storage: Path) -> None:
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
        from huggingface_hub.utils._runtime import is_xet_available

        url = hf_hub_url(self.repo, name, revision=commit)
        meta = get_hf_file_metadata(url, token=self.token, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        if not meta.etag or not meta.commit_hash:
            raise DownloadError(f"{constants.ENDPOINT} does not answer like a Hugging Face hub "
                                f"for {name} (no ETag or X-Repo-Commit); check HF_ENDPOINT")
        blob = storage / "blobs" / meta.etag
        via_xet = self.xet and meta.xet_file_data is not None and is_xet_available()
        if not blob.exists() and not via_xet:
            self.fetch_blob(name, url, meta, blob, storage)
        # Links the blob into the snapshot (or, for Xet, downloads it), hf's own way.
        hf_hub_download(self.repo, name, revision=commit, cache_dir=str(self.cache),
                        token=self.token, tqdm_class=self.tqdm_class)

    def fetch_blob(self, name: str, url: str, meta, blob: Path, storage: Path) -> None:
        import httpx2
        from huggingface_hub import get_hf_file_metadata
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import WeakFileLock, build_hf_headers

        size = meta.size
        partial = partial_blob(blob)
        lock = self.cache / ".locks" / storage.name / f"{meta.etag}.lock"
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(str(lock)):
            if blob.exists():  # another process finished it meanwhile
                return
            for attempt in range(_ROUNDS):
                have = partial.stat().st_size if partial.exists() else 0
                if size is not None and have > size:
                    have = 0
                if have:
                    self.say(f"{name}: resuming at {format_size(have)}"
                             + (f" of {format_size(size)}" if size else ""))
                headers = build_hf_headers(token=self.token)
                if _origin(meta.location) != _origin(url):
                    headers.pop("authorization", None)  # a CDN: the token stays on the hub
                try:
                    with open(partial, "r+b" if partial.exists() else "wb") as fh:
                        fh.seek(have)
                        fh.truncate()
                        http_get(meta.location, fh, resume_size=have, headers=headers,
                                 expected_size=size, displayed_filename=name,
                                 tqdm_class=self.tqdm_class)
                    break
                except (httpx2.TransportError, HfHubHTTPError, OSError) as error:
                    grew = partial.exists() and partial.stat().st_size > have
                    retry = isinstance(error, (httpx2.TransportError, HfHubHTTPError)) or (
                        "Consistency check failed" in str(error))
                    if attempt == _ROUNDS - 1 or not grew or not retry:
                        raise
                    # Continue with fresh metadata (a signed CDN URL may have expired).
                    meta = get_hf_file_metadata(url, token=self.token)
            self.verify(name, partial, meta.etag)
            os.replace(partial, blob)

    def damage(self, path: Path, expected: str | None) -> str | None:
        self.say(f"{path.name}: checking sha256")
        return damaged_in_cache(path, expected)

    def drop_damaged(self, snapshot: Path, siblings, wanted: tuple[str, ...],
                     todo: list[str]) -> list[str]:
        """Removes the cached files that do not match the hub's sha256 -> their names."""
        damaged = []
        for name in wanted:
            lfs = siblings[name].lfs
            damage = None if name in todo else self.damage(snapshot / name,
                                                            lfs.sha256 if lfs else None)
            if damage:
                self.say(f"{damage}; fetching it again")
                (snapshot / name).resolve().unlink(missing_ok=True)
                (snapshot / name).unlink(missing_ok=True)
                damaged.append(name)
        return damaged

    def verify(self, name: str, path: Path, etag: str) -> None:
        """An LFS blob is named by its sha256: check it before it enters the cache."""
        if not SHA256.fullmatch(etag):
            return
        self.say(f"{name}: checking sha256")
        got = sha256_file(path)
        if got != etag:
            path.unlink(missing_ok=True)
            raise DownloadError(
                f"{name} does not match its sha256 after the download (expected {etag[:16]}…, "
                f"got {got[:16]}…); the partial file was removed, run the command again")

    # -- bookkeeping ---------------------------------------------------------------------
    def still_needed(self, storage: Path, sibling, size: int | None) -> int:
        etag = sibling.lfs.sha256 if sibling.lfs else sibling.blob_id
        if not size:
            return 0
        if etag:
            blob = storage / "blobs" / etag
            if blob.exists():
                return 0
            partial = partial_blob(blob)
            if partial.exists():
                return max(size - partial.stat().st_size, 0)
        return size

    def free_space(self) -> int | None:
        try:
            return shutil.disk_usage(existing_parent(self.cache)).free
        except OSError:
            return None

    def check_space(self, needed: int) -> None:
        free = self.free_space()
        if free is not None and needed > free:
            raise DiskFullError(
                f"not enough space for {self.repo} in the Hugging Face cache {self.cache}: "
                f"the download needs {format_size(needed)} more "
                f"({format_size(self.total or needed)} in all) and {format_size(free)} is free; "
                "free some space, or point HF_HUB_CACHE (or HF_HOME) at a larger disk")

    def write_ref(self, storage: Path, commit: str) -> None:
        if self.revision and COMMIT_HASH.fullmatch(self.revision):
            return
        ref = storage / "refs" / self.rev_label
        try:
            if ref.read_text() == commit:
                return
        except OSError:
            pass
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)

    # -- errors --------------------------------------------------------------------------
    def translate(self, error: Exception) -> PersonaplexError | None:
        import httpx2
        from huggingface_hub import constants
        from huggingface_hub import errors as hf

        repo, rev = self.repo, self.rev_label
        # GatedRepoError subclasses RepositoryNotFoundError: it must come first.
        if isinstance(error, hf.GatedRepoError):
            status = _status(error)
            if status == 403:
                return HubAccessError(
                    f"model {repo} is gated and your Hugging Face token has no access to it: "
                    f"accept the licence at {licence_url(repo)} with the token's account, or "
                    "log in as an account that did (`hf auth login` or HF_TOKEN)")
            if _sent_token(error):
                return HubAccessError(
                    f"model {repo} is gated and the hub did not accept your Hugging Face "
                    f"token: accept the licence at {licence_url(repo)}, then check "
                    "`hf auth login` or HF_TOKEN")
            return HubAccessError(
                f"model {repo} is gated and no Hugging Face token was sent: accept the "
                f"licence at {licence_url(repo)}, then run `hf auth login` or set HF_TOKEN")
        if isinstance(error, hf.RepositoryNotFoundError):
            return HubNotFoundError(
                f"model repo {repo} does not exist on the Hugging Face hub (or it is private "
                "and your token cannot see it)")
        if isinstance(error, hf.RevisionNotFoundError):
            return HubNotFoundError(f"revision {rev!r} does not exist in model repo {repo}")
        if isinstance(error, hf.RemoteEntryNotFoundError):
            return HubNotFoundError(
                f"model repo {repo} (revision {rev}) has no file {self.current or '?'}")
        if isinstance(error, hf.HfHubHTTPError):
            status = _status(error)
            if status == 401:
                return HubAccessError(
                    "the Hugging Face hub rejected your token (invalid or expired): run "
                    "`hf auth login` again, or set HF_TOKEN to a valid token")
            if status == 403:
                return HubAccessError(
                    f"the Hugging Face hub refused access to {repo} (HTTP 403); check that "
                    f"your token may read it ({licence_url(repo)})")
            return DownloadError(
                f"the Hugging Face hub answered HTTP {status} while fetching "
                f"{self.current or repo}; try again later")
        if isinstance(error, hf.FileMetadataError) or isinstance(
                error.__cause__, hf.FileMetadataError):
            return DownloadError(
                f"{constants.ENDPOINT} does not answer like a Hugging Face hub; check "
                "HF_ENDPOINT, your proxy and firewall")
        if isinstance(error, hf.LocalEntryNotFoundError):  # hf fell back to the cache, in vain
            return self.unreachable(error.__cause__ or error)
        if isinstance(error, httpx2.TransportError) and self.current is not None and not (
                isinstance(error, (httpx2.ConnectError, httpx2.ConnectTimeout))):
            return DownloadError(
                f"the transfer of {self.current} broke off ({_reason(error)}); run the "
                "command again to resume it (what was fetched is kept)")
        if isinstance(error, (httpx2.TransportError, hf.OfflineModeIsEnabled)):
            return self.unreachable(error)
        if _is_disk_full(error):
            free = self.free_space()
            return DiskFullError(
                f"no space left in the Hugging Face cache {self.cache} while downloading "
                f"{self.current or repo}: the model needs {format_size(self.total or 0)} "
                f"({format_size(self.needed or 0)} to fetch)"
                + (f" and {format_size(free)} is free" if free is not None else "")
                + "; free some space or point HF_HUB_CACHE at a larger disk, then run again "
                "to resume")
        if isinstance(error, OSError) and "Consistency check failed" in str(error):
            return DownloadError(
                f"the transfer of {self.current or repo} ended early; run the command again "
                "to resume it")
        if isinstance(error, OSError):
            return OutputError(f"cannot write to the Hugging Face cache {self.cache}: "
                               f"{error.strerror or error}")
        return None

    def unreachable(self, error: BaseException) -> HubUnreachableError:
        from huggingface_hub import constants

        snapshot, missing = locate_snapshot(self.cache, self.repo, self.revision, HUB_FILES)
        hint = (f"; {self.repo} is already complete in the cache, so HF_HUB_OFFLINE=1 uses it"
                if snapshot is not None and not missing else
                ", or set HF_HUB_OFFLINE=1 to use what is already in the cache")
        return HubUnreachableError(
            f"could not reach the Hugging Face hub at {constants.ENDPOINT} ({_reason(error)}); "
            f"check your network connection or proxy{hint}")


# -- helpers -----------------------------------------------------------------------------------

def _reason(error: BaseException) -> str:
    """A short reason for a network error: 'timed out', '[Errno 111] Connection refused'."""
    import httpx2

    if isinstance(error, httpx2.TimeoutException):
        return "timed out"
    text = str(error).strip()
    if isinstance(error, httpx2.ProxyError):
        return f"proxy error: {text}" if text else "proxy error"
    return text.splitlines()[0] if text else type(error).__name__


def _sibling_size(sibling) -> int | None:
    if sibling.lfs is not None:
        return sibling.lfs.size
    return sibling.size


def _status(error) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _sent_token(error) -> bool:
    request = getattr(getattr(error, "response", None), "request", None)
    return bool(request is not None and request.headers.get("authorization"))


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


def _is_disk_full(error: BaseException) -> bool:
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def _silent_tqdm_class():
    from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

    class SilentTqdm(hf_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentTqdm


@contextmanager
def _hub_logs(quiet: bool) -> Iterator[None]:
    """With `quiet`, huggingface_hub logs errors only for the duration of the call."""
    if not quiet:
        yield
        return
    import huggingface_hub.utils.logging  # noqa: F401 - configures its logger once, on import

    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
