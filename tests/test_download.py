"""`download()` against a local hub server, through the real huggingface_hub code path.

huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE when it is
imported, so each download runs in a subprocess with its own environment (`run_download`).
`DOWNLOAD_COMMAND` is the only thing to change once `personaplex download` exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from hub_server import HubServer, closed_port, tgz, wait_until
from personaplex_cli.errors import (
    EXIT_MODEL_INVALID,
    EXIT_MODEL_MISSING,
    EXIT_OUTPUT,
    EXIT_USAGE,
    ModelInvalidError,
    UnsafeArchiveError,
)
from personaplex_cli.model.files import cached_snapshot
from personaplex_cli.model.files import (
    ARCH_FILE,
    DEFAULT_MODEL,
    HUB_FILES,
    LM_FILE,
    MIMI_FILE,
    TOKENIZER_FILE,
    VOICES_ARCHIVE,
    ModelNotFoundError,
    resolve_model,
)
from personaplex_cli.model.voices_archive import STAMP_NAME, extract_voices, format_size

REPO = DEFAULT_MODEL
MIB = 1024 * 1024
CHUNK = 10 * MIB  # huggingface_hub's DOWNLOAD_CHUNK_SIZE: what reaches the disk at a time
GOOD_TOKEN = "hf_good_token"
WRONG_TOKEN = "hf_not_on_the_list"

DOWNLOAD_COMMAND = [sys.executable, "-m", "personaplex_cli", "download"]

_SCRUBBED_PREFIXES = ("HF_", "HUGGINGFACE_", "PERSONAPLEX_", "TQDM_")


def hub_env(tmp_path: Path, hub: HubServer | None = None, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_SCRUBBED_PREFIXES) and k != "TRANSFORMERS_OFFLINE"}
    env.update({
        "HF_HOME": str(tmp_path / "hf-home"),  # no stored token: HF_TOKEN only
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "NO_COLOR": "1",
    })
    if hub is not None:
        env["HF_ENDPOINT"] = hub.url
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


def run_download(args, env, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*DOWNLOAD_COMMAND, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def start_download(args, env) -> subprocess.Popen:
    return subprocess.Popen([*DOWNLOAD_COMMAND, *map(str, args)], env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def result_of(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines()
             if line.startswith("personaplex: error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# -- the fake repo ---------------------------------------------------------------------------

def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


VOICE_FILES = {"NATF0.pt": random_bytes(3000, 10), "NATM1.pt": random_bytes(2000, 11),
               "VARF2.pt": random_bytes(1000, 12)}


def voices_tgz() -> bytes:
    return tgz([("voices", None)] + [(f"voices/{n}", d) for n, d in VOICE_FILES.items()])


def model_files(lm_size: int = 300_000, voices: bytes | None = None) -> dict[str, bytes]:
    return {
        LM_FILE: random_bytes(lm_size, 1),
        MIMI_FILE: random_bytes(120_000, 2),
        TOKENIZER_FILE: random_bytes(20_000, 3),
        VOICES_ARCHIVE: voices if voices is not None else voices_tgz(),
        # Files the tool must not fetch:
        "dist.tgz": random_bytes(50_000, 4),
        "config.json": b'{"model_type": "personaplex"}\n',
        "README.md": b"# PersonaPlex\n",
    }


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


def storage_of(cache: Path, repo: str = REPO) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


def sha256(data_or_path) -> str:
    data = Path(data_or_path).read_bytes() if isinstance(data_or_path, Path) else data_or_path
    return hashlib.sha256(data).hexdigest()


def fetched_names(hub: HubServer) -> list[str]:
    """The repo files whose body was requested (through the CDN or directly)."""
    names = []
    for request in hub.body_gets():
        if request.role == "cdn":
            names.append(dict(p.split("=", 1) for p in request.query.split("&"))["name"])
        else:
            names.append(request.file)
    return names


# -- a fresh download ------------------------------------------------------------------------

def test_fresh_download_lands_in_the_hub_cache(hub, tmp_path):
    repo = hub.add_repo(REPO, model_files())
    env = hub_env(tmp_path, hub)
    proc = run_download(["--json"], env)
    result = result_of(proc)
    cache = tmp_path / "cache"
    storage = storage_of(cache)
    snapshot = storage / "snapshots" / repo.commit
    assert result["repo"] == REPO
    assert result["revision"] == repo.commit
    assert Path(result["path"]) == snapshot
    assert [f["name"] for f in result["files"]] == list(HUB_FILES)
    for entry in result["files"]:
        served = repo.files[entry["name"]]
        assert entry["size"] == served.size
        link = snapshot / entry["name"]
        assert link.is_symlink()  # huggingface_hub's layout: snapshot links -> blobs
        assert link.resolve() == (storage / "blobs" / served.etag).resolve()
        assert sha256(link) == served.sha256
    assert (storage / "refs" / "main").read_text() == repo.commit
    assert not list(storage.rglob("*.incomplete"))
    # Exactly the four files, nothing else (no dist.tgz, config.json, README.md).
    assert sorted(fetched_names(hub)) == sorted(HUB_FILES)
    # A HEAD for the metadata, and hf_hub_download's own when it links the blob.
    assert sorted(r.file for r in hub.requests if r.method == "HEAD") == sorted(HUB_FILES * 2)
    assert not [r for r in hub.requests if r.role == "cdn" and r.token]
    # voices.tgz unpacked beside it, as NVIDIA's code expects.
    voices = snapshot / "voices"
    assert sorted(p.name for p in voices.glob("*.pt")) == sorted(VOICE_FILES)
    for name, data in VOICE_FILES.items():
        assert (voices / name).read_bytes() == data
    assert not [p for p in snapshot.iterdir() if p.name.startswith(".voices")]
    # The snapshot is a model directory; the cache finds it without the network.
    model = resolve_model(str(snapshot))
    assert model.lm_file().name == LM_FILE
    assert model.mimi_file().name == MIMI_FILE
    assert model.tokenizer_file().name == TOKENIZER_FILE
    assert cached_snapshot(REPO, cache_dir=cache) == snapshot
    assert cached_snapshot(REPO, repo.commit, cache_dir=cache) == snapshot


def test_an_architecture_file_in_the_repo_is_fetched_too(hub, tmp_path):
    """A checkpoint of other dimensions describes itself with personaplex-arch.json (the
    README's test serves the tiny model so): fetched with the four files, listed after them,
    and a second run fetches nothing. NVIDIA's repo has none (above: exactly four files)."""
    files = {**model_files(), ARCH_FILE: b'{"lm": {"dim": 64}}\n'}
    hub.add_repo(REPO, files)
    env = hub_env(tmp_path, hub)
    result = result_of(run_download(["--json"], env))
    assert [f["name"] for f in result["files"]] == [*HUB_FILES, ARCH_FILE]
    assert (Path(result["path"]) / ARCH_FILE).read_bytes() == files[ARCH_FILE]
    assert sorted(fetched_names(hub)) == sorted([*HUB_FILES, ARCH_FILE])
    hub.clear_log()
    again = result_of(run_download(["--json"], env))
    assert again["files"] == result["files"] and fetched_names(hub) == []


def test_hf_home_decides_the_cache_and_resolve_model_finds_it(hub, tmp_path):
    repo = hub.add_repo(REPO, model_files())
    env = hub_env(tmp_path, hub, HF_HUB_CACHE=None)
    result = result_of(run_download(["--json"], env))
    snapshot = storage_of(tmp_path / "hf-home" / "hub") / "snapshots" / repo.commit
    assert Path(result["path"]) == snapshot
    # Another command, with the hub out of reach: the cache alone is enough.
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}"
    code = ("from personaplex_cli.model.files import resolve_model\n"
            "m = resolve_model(None)\nprint(m.path)\nprint(m.lm_file())")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(snapshot), str(snapshot / LM_FILE)]


def test_second_run_fetches_nothing(hub, tmp_path):
    repo = hub.add_repo(REPO, model_files())
    env = hub_env(tmp_path, hub)
    first = result_of(run_download(["--json"], env))
    voices_stamp = Path(first["path"], "voices", STAMP_NAME).stat().st_mtime_ns
    hub.clear_log()
    second = result_of(run_download(["--json"], env))
    assert second == first
    assert hub.body_gets() == []
    assert [(r.method, r.path) for r in hub.requests] == [
        ("GET", f"/api/models/{REPO}")]  # the revision lookup, nothing else
    assert Path(first["path"], "voices", STAMP_NAME).stat().st_mtime_ns == voices_stamp
    # Pinned to the commit: not even that.
    hub.clear_log()
    assert result_of(run_download(["--revision", repo.commit, "--json"], env)) == first
    assert hub.requests == []


# -- resuming ----------------------------------------------------------------------------------

def test_connection_cut_mid_file_is_resumed_with_range(hub, tmp_path):
    files = model_files(lm_size=24 * MIB)
    repo = hub.add_repo(REPO, files)
    hub.cut_after(LM_FILE, 15 * MIB)  # one 10 MiB chunk reaches the disk first
    env = hub_env(tmp_path, hub)
    result = result_of(run_download(["--json", "--quiet"], env))
    lm_gets = [r for r in hub.body_gets() if "name=model.safetensors" in r.query]
    assert [r.range for r in lm_gets] == [None, f"bytes={CHUNK}-"]
    assert lm_gets[1].status == 206
    assert hub.bytes_served[LM_FILE] == 15 * MIB + (24 * MIB - CHUNK)
    assert sha256(Path(result["path"]) / LM_FILE) == repo.files[LM_FILE].sha256


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill", "ctrl-c"])
def test_interrupted_run_is_resumed_by_the_next(hub, tmp_path, sig):
    files = model_files(lm_size=24 * MIB)
    repo = hub.add_repo(REPO, files)
    lm = repo.files[LM_FILE]
    hub.stall_after(LM_FILE, 15 * MIB)
    env = hub_env(tmp_path, hub)
    partial = storage_of(tmp_path / "cache") / "blobs" / f"{lm.sha256}.incomplete"
    proc = start_download(["--json", "--quiet"], env)
    try:
        assert hub.wait_stalled(60)
        assert wait_until(lambda: partial.exists() and partial.stat().st_size == CHUNK, 30)
        proc.send_signal(sig)
        proc.communicate(timeout=30)
    finally:
        hub.release()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL)
    assert partial.stat().st_size == CHUNK  # kept for the next run
    hub.clear_log()
    again = run_download(["--json"], env)
    result = result_of(again)
    assert f"{LM_FILE}: resuming at 10.5 MB of 25.2 MB" in again.stderr
    lm_gets = [r for r in hub.body_gets() if "name=model.safetensors" in r.query]
    assert [r.range for r in lm_gets] == [f"bytes={CHUNK}-"]
    assert hub.bytes_served[LM_FILE] == lm.size - CHUNK
    assert sha256(Path(result["path"]) / LM_FILE) == lm.sha256
    assert not partial.exists()


def test_a_transfer_that_keeps_breaking_says_so(hub, tmp_path):
    hub.add_repo(REPO, model_files())
    hub.cut_after(MIMI_FILE, 1000, times=100)
    env = hub_env(tmp_path, hub)
    proc = run_download(["--json", "--quiet"], env)
    assert proc.returncode == EXIT_MODEL_MISSING
    message = error_line(proc)
    assert f"the transfer of {MIMI_FILE} broke off (peer closed connection" in message
    assert "run the command again to resume it" in message
    assert "Trying to resume" not in proc.stderr  # quiet: no huggingface_hub warnings
    # huggingface_hub's own retries (6 GETs), then ours stop: nothing reached the disk.
    assert fetched_names(hub).count(MIMI_FILE) == 6


def test_two_downloads_at_once_fetch_each_file_once(hub, tmp_path):
    repo = hub.add_repo(REPO, model_files(lm_size=12 * MIB))
    hub.stall_after(LM_FILE, 11 * MIB)  # whoever fetches first holds the file's lock a while
    env = hub_env(tmp_path, hub)
    procs = [start_download(["--json", "--quiet"], env) for _ in range(2)]
    try:
        assert hub.wait_stalled(60)
        time.sleep(1)  # the other one is waiting for the lock by now
        hub.release()
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        hub.release()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    paths = {json.loads(out.strip().splitlines()[-1])["path"] for out, _ in outputs}
    assert len(paths) == 1
    assert sorted(fetched_names(hub)).count(LM_FILE) == 2  # the stalled GET and its resume
    # 11 MiB before the stall, then from the last full chunk on: one process fetched it.
    assert hub.bytes_served[LM_FILE] == 11 * MIB + repo.files[LM_FILE].size - CHUNK
    assert sha256(Path(paths.pop()) / LM_FILE) == repo.files[LM_FILE].sha256


def test_a_corrupt_transfer_is_not_kept(hub, tmp_path):
    repo = hub.add_repo(REPO, model_files())
    hub.corrupt.add(MIMI_FILE)
    env = hub_env(tmp_path, hub)
    proc = run_download(["--json", "--quiet"], env)
    assert proc.returncode == EXIT_MODEL_MISSING
    assert f"{MIMI_FILE} does not match its sha256" in error_line(proc)
    blobs = storage_of(tmp_path / "cache") / "blobs"
    assert not (blobs / repo.files[MIMI_FILE].etag).exists()
    assert not list(blobs.glob("*.incomplete"))
    hub.corrupt.clear()
    assert result_of(run_download(["--json"], env))["revision"] == repo.commit


def test_verify_fetches_a_file_damaged_in_the_cache_again(hub, tmp_path):
    """A byte changed in a cached blob (same size, a valid header) goes unseen by a plain
    run; --verify checks it against the hub's sha256 and fetches it again; offline, it
    says so with exit 6 (issue 20.4)."""
    repo = hub.add_repo(REPO, model_files())
    env = hub_env(tmp_path, hub)
    first = result_of(run_download(["--json"], env))
    blob = (Path(first["path"]) / LM_FILE).resolve()
    data = bytearray(blob.read_bytes())
    data[1000] ^= 0xFF
    blob.write_bytes(bytes(data))
    hub.clear_log()
    assert result_of(run_download(["--json"], env)) == first
    assert fetched_names(hub) == []  # not checked: it is there

    offline = run_download(["--json", "--verify"], {**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == EXIT_MODEL_INVALID, offline.stderr
    assert f"{LM_FILE} does not match the sha256 the hub gives" in error_line(offline)

    hub.clear_log()
    proc = run_download(["--json", "--verify"], env)
    assert result_of(proc) == first
    assert fetched_names(hub) == [LM_FILE]
    assert "damaged after the download; fetching it again" in proc.stderr
    assert sha256(blob) == repo.files[LM_FILE].sha256


# -- access and existence ------------------------------------------------------------------------

def test_gated_repo_without_a_token(hub, tmp_path):
    hub.add_repo(REPO, model_files(), gated=True, authorized_tokens={GOOD_TOKEN})
    proc = run_download(["--json"], hub_env(tmp_path, hub))
    assert proc.returncode == EXIT_MODEL_MISSING
    message = error_line(proc)
    assert "is gated and no Hugging Face token was sent" in message
    assert "https://huggingface.co/nvidia/personaplex-7b-v1" in message
    assert "`hf auth login`" in message and "HF_TOKEN" in message
    assert [r.status for r in hub.requests if r.method == "HEAD"] == [401]
    assert hub.body_gets() == []


def test_gated_repo_with_a_token_not_on_the_list(hub, tmp_path):
    hub.add_repo(REPO, model_files(), gated=True, authorized_tokens={GOOD_TOKEN})
    proc = run_download(["--json"], hub_env(tmp_path, hub, HF_TOKEN=WRONG_TOKEN))
    assert proc.returncode == EXIT_MODEL_MISSING
    message = error_line(proc)
    assert "your Hugging Face token has no access" in message
    assert "https://huggingface.co/nvidia/personaplex-7b-v1" in message
    assert [r.status for r in hub.requests if r.method == "HEAD"] == [403]


def test_gated_repo_for_another_repo_names_its_page(hub, tmp_path):
    hub.add_repo("someone/other-plex", model_files(), gated=True)
    proc = run_download(["--model", "someone/other-plex", "--json"], hub_env(tmp_path, hub))
    assert proc.returncode == EXIT_MODEL_MISSING
    assert "https://huggingface.co/someone/other-plex" in error_line(proc)


def test_token_from_hf_token_and_token_argument_overrides_it(hub, tmp_path):
    hub.add_repo(REPO, model_files(), gated=True, authorized_tokens={GOOD_TOKEN})
    result_of(run_download(["--json"], hub_env(tmp_path / "a", hub, HF_TOKEN=GOOD_TOKEN)))
    hub_requests = [r for r in hub.requests if r.role == "hub"]
    assert hub_requests and all(r.token == GOOD_TOKEN for r in hub_requests)
    assert all(r.token is None for r in hub.requests if r.role == "cdn")  # not off the hub
    hub.clear_log()
    env = hub_env(tmp_path / "b", hub, HF_TOKEN=WRONG_TOKEN)
    result_of(run_download(["--token", GOOD_TOKEN, "--json"], env))
    assert {r.token for r in hub.requests if r.role == "hub"} == {GOOD_TOKEN}


def test_a_token_the_hub_does_not_know(hub, tmp_path):
    hub.add_repo(REPO, model_files(), rejected_tokens={"hf_expired"})
    proc = run_download(["--json"], hub_env(tmp_path, hub, HF_TOKEN="hf_expired"))
    assert proc.returncode == EXIT_MODEL_MISSING
    assert "rejected your token" in error_line(proc)


def test_missing_repo_revision_or_file(hub, tmp_path):
    hub.add_repo(REPO, model_files())
    files = model_files()
    del files[VOICES_ARCHIVE]
    hub.add_repo("someone/not-personaplex", files)
    env = hub_env(tmp_path, hub)
    proc = run_download(["--model", "nobody/nothing", "--json"], env)
    assert proc.returncode == EXIT_MODEL_MISSING
    assert "model repo nobody/nothing does not exist" in error_line(proc)
    proc = run_download(["--revision", "v9", "--json"], env)
    assert proc.returncode == EXIT_MODEL_MISSING
    assert "revision 'v9' does not exist in model repo nvidia/personaplex-7b-v1" in error_line(proc)
    proc = run_download(["--model", "someone/not-personaplex", "--json"], env)
    assert proc.returncode == EXIT_MODEL_MISSING
    assert "has no voices.tgz: it does not look like a PersonaPlex repo" in error_line(proc)
    for bad in ("not a repo", "bad repo!", "nvidia"):  # bad usage (issue 13.11)
        proc = run_download(["--model", bad, "--json"], env)
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert f"{bad!r} is not a valid Hugging Face repo id" in error_line(proc)
    assert hub.body_gets() == []


# -- offline and no network ------------------------------------------------------------------------

def test_offline_with_nothing_cached(hub, tmp_path):
    hub.add_repo(REPO, model_files())
    proc = run_download(["--json"], hub_env(tmp_path, hub, HF_HUB_OFFLINE=1))
    assert proc.returncode == EXIT_MODEL_MISSING
    message = error_line(proc)
    assert "HF_HUB_OFFLINE is set" in message and "not completely in the local" in message
    assert str(tmp_path / "cache") in message
    assert hub.requests == []


def test_offline_with_the_cache_complete(hub, tmp_path):
    hub.add_repo(REPO, model_files())
    env = hub_env(tmp_path, hub)
    first = result_of(run_download(["--json"], env))
    hub.clear_log()
    env["HF_HUB_OFFLINE"] = "1"
    assert result_of(run_download(["--json"], env)) == first
    assert hub.requests == []


@pytest.mark.parametrize("endpoint", ["closed-port", "unknown-host"])
def test_no_network(hub, tmp_path, endpoint):
    url = (f"http://127.0.0.1:{closed_port()}" if endpoint == "closed-port"
           else "http://hub.personaplex-test.invalid")
    env = hub_env(tmp_path, None, HF_ENDPOINT=url)
    started = time.monotonic()
    proc = run_download(["--json"], env, timeout=60)
    assert proc.returncode == EXIT_MODEL_MISSING
    message = error_line(proc)
    assert f"could not reach the Hugging Face hub at {url}" in message
    assert "HF_HUB_OFFLINE=1" in message
    assert time.monotonic() - started < 30


def test_hub_that_does_not_answer(hub, tmp_path):
    hub.add_repo(REPO, model_files())
    hub.stall_api = True
    env = hub_env(tmp_path, hub, HF_HUB_ETAG_TIMEOUT=1)
    proc = run_download(["--json"], env, timeout=60)
    hub.release()
    assert proc.returncode == EXIT_MODEL_MISSING
    assert "(timed out)" in error_line(proc)


def test_unreachable_hub_says_when_the_cache_is_complete(hub, tmp_path):
    hub.add_repo(REPO, model_files())
    env = hub_env(tmp_path, hub)
    result_of(run_download(["--json"], env))
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}"
    proc = run_download(["--json"], env)
    assert proc.returncode == EXIT_MODEL_MISSING
    assert "is already complete in the cache, so HF_HUB_OFFLINE=1 uses it" in error_line(proc)


# -- progress ----------------------------------------------------------------------------------

def test_progress_bars_on_stderr_unless_quiet(hub, tmp_path):
    hub.add_repo(REPO, model_files())
    # TQDM_POSITION=-1 makes huggingface_hub draw its bars without a terminal.
    env = hub_env(tmp_path / "a", hub, TQDM_POSITION=-1)
    proc = run_download(["--json"], env)
    result_of(proc)
    assert f"{LM_FILE}: 100%" in proc.stderr
    assert "%|" not in proc.stdout
    quiet = run_download(["--json", "--quiet"], hub_env(tmp_path / "b", hub, TQDM_POSITION=-1))
    result_of(quiet)
    assert "%|" not in quiet.stderr
    env = hub_env(tmp_path / "c", hub, TQDM_POSITION=-1, HF_HUB_DISABLE_PROGRESS_BARS=1)
    off = run_download(["--json"], env)
    result_of(off)
    assert "%|" not in off.stderr


# -- a full disk ---------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """`small_disk(bytes)` -> a folder on a tmpfs of that size (needs root to mount)."""
    mounts = []

    def make(size: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755",
                               "tmpfs", str(folder)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounts.append(folder)
        return folder

    yield make
    for folder in mounts:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_not_enough_space_is_said_before_fetching(hub, small_disk, tmp_path):
    repo = hub.add_repo(REPO, model_files(lm_size=2 * MIB))
    needed = sum(repo.files[name].size for name in HUB_FILES)
    disk = small_disk(1 * MIB)
    env = hub_env(tmp_path, hub, HF_HUB_CACHE=disk / "cache")
    proc = run_download(["--json"], env)
    assert proc.returncode == EXIT_OUTPUT
    message = error_line(proc)
    assert f"not enough space for {REPO} in the Hugging Face cache {disk / 'cache'}" in message
    assert f"the download needs {format_size(needed)} more" in message
    assert hub.body_gets() == []


def test_disk_filling_up_while_writing(hub, small_disk, tmp_path):
    repo = hub.add_repo(REPO, model_files(lm_size=1 * MIB))
    disk = small_disk(3 * MIB)
    filler = disk / "filler"

    def fill_disk(repo_id, name):  # something else takes the space once the checks are done
        if name == LM_FILE and not filler.exists():
            with open(filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 65536)
                        fh.flush()
                except OSError:
                    pass

    hub.on_body = fill_disk
    env = hub_env(tmp_path, hub, HF_HUB_CACHE=disk / "cache")
    proc = run_download(["--json", "--quiet"], env)
    assert proc.returncode == EXIT_OUTPUT, proc.stderr
    message = error_line(proc)
    assert f"no space left in the Hugging Face cache {disk / 'cache'}" in message
    assert "the model needs 1.2 MB" in message
    hub.on_body = None
    filler.unlink()
    result = result_of(run_download(["--json"], env))
    assert sha256(Path(result["path"]) / LM_FILE) == repo.files[LM_FILE].sha256


# -- voices.tgz ----------------------------------------------------------------------------------

def _info(name, kind, **attrs) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in attrs.items():
        setattr(info, key, value)
    return info


HOSTILE = {
    "symlink": [("voices", None),
                _info("voices/NATF0.pt", tarfile.SYMTYPE, linkname="/etc/passwd")],
    "symlink-then-write-through": [
        ("voices", None), _info("voices/out", tarfile.SYMTYPE, linkname="../../outside"),
        ("voices/out/evil.pt", b"evil")],
    "hardlink": [("voices", None), ("voices/a.pt", b"a"),
                 _info("voices/b.pt", tarfile.LNKTYPE, linkname="voices/a.pt")],
    "absolute": [("voices", None), ("/tmp/personaplex-evil.pt", b"evil")],
    "dotdot": [("voices", None), ("voices/../../outside/evil.pt", b"evil")],
    "dotdot-top": [("../evil.pt", b"evil"), ("voices/a.pt", b"a")],
    "fifo": [("voices", None), _info("voices/pipe", tarfile.FIFOTYPE)],
    "char-device": [("voices", None),
                    _info("voices/null", tarfile.CHRTYPE, devmajor=1, devminor=3)],
    "block-device": [("voices", None),
                     _info("voices/sda", tarfile.BLKTYPE, devmajor=8, devminor=0)],
    # A valid member first: nothing at all may be written before the bad one is seen.
    "bad-member-last": [("voices", None), ("voices/NATF0.pt", b"fine"),
                        ("voices/../evil.pt", b"evil")],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_voices_archive_is_refused(tmp_path, case):
    home = tmp_path / "snapshot"
    home.mkdir()
    archive = home / VOICES_ARCHIVE
    archive.write_bytes(tgz(HOSTILE[case]))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(UnsafeArchiveError, match="voices.tgz is refused") as caught:
        extract_voices(archive)
    assert caught.value.exit_code == EXIT_MODEL_INVALID
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert not Path("/tmp/personaplex-evil.pt").exists()


def test_hostile_voices_archive_from_the_hub(hub, tmp_path):
    repo = hub.add_repo(REPO, model_files(voices=tgz(HOSTILE["dotdot"])))
    proc = run_download(["--json"], hub_env(tmp_path, hub))
    assert proc.returncode == EXIT_MODEL_INVALID
    assert "voices.tgz is refused: member 'voices/../../outside/evil.pt' contains '..'" in (
        error_line(proc))
    snapshot = storage_of(tmp_path / "cache") / "snapshots" / repo.commit
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(HUB_FILES)
    assert not (tmp_path / "cache" / "models--nvidia--personaplex-7b-v1" / "outside").exists()


def test_voices_extraction_is_idempotent_and_replaces_a_changed_archive(tmp_path):
    archive = tmp_path / VOICES_ARCHIVE
    archive.write_bytes(voices_tgz())
    target = extract_voices(archive)
    assert target == tmp_path / "voices"
    assert sorted(p.name for p in target.glob("*.pt")) == sorted(VOICE_FILES)
    stamp = (target / STAMP_NAME).stat().st_mtime_ns
    os.utime(target / "NATF0.pt", ns=(1, 1))
    assert extract_voices(archive) == target
    assert (target / STAMP_NAME).stat().st_mtime_ns == stamp  # nothing done
    assert (target / "NATF0.pt").stat().st_mtime_ns == 1
    # Touched, same content: still nothing to do.
    os.utime(archive, ns=(2_000_000_000, 2_000_000_000))
    extract_voices(archive)
    assert (target / "NATF0.pt").stat().st_mtime_ns == 1
    # A voice file gone: extracted again.
    (target / "NATM1.pt").unlink()
    extract_voices(archive)
    assert (target / "NATM1.pt").read_bytes() == VOICE_FILES["NATM1.pt"]
    # Another archive: the folder is replaced as a whole.
    archive.write_bytes(tgz([("voices/NEW.pt", b"new")]))
    extract_voices(archive)
    assert sorted(p.name for p in target.iterdir()) == [STAMP_NAME, "NEW.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["voices", VOICES_ARCHIVE]


def test_voices_archive_layouts_and_damage(tmp_path):
    # Without a voices/ folder the files are taken from the top level; "./" prefixes are fine.
    flat = tmp_path / "flat" / VOICES_ARCHIVE
    flat.parent.mkdir()
    flat.write_bytes(tgz([("./NATF0.pt", b"flat")]))
    assert (extract_voices(flat) / "NATF0.pt").read_bytes() == b"flat"
    # Other top-level entries beside voices/ are checked but not extracted.
    extra = tmp_path / "extra" / VOICES_ARCHIVE
    extra.parent.mkdir()
    extra.write_bytes(tgz([("._voices", b"mac"), ("voices/A.pt", b"a")]))
    extract_voices(extra)
    assert sorted(p.name for p in extra.parent.iterdir()) == ["voices", VOICES_ARCHIVE]
    # Truncated: a clear error, and no voices/.
    broken = tmp_path / "broken" / VOICES_ARCHIVE
    broken.parent.mkdir()
    broken.write_bytes(voices_tgz()[:200])
    with pytest.raises(ModelInvalidError, match="voices.tgz is damaged or truncated"):
        extract_voices(broken)
    assert sorted(p.name for p in broken.parent.iterdir()) == [VOICES_ARCHIVE]
    empty = tmp_path / "empty" / VOICES_ARCHIVE
    empty.parent.mkdir()
    empty.write_bytes(tgz([("voices", None)]))
    with pytest.raises(ModelInvalidError, match="holds no voice files"):
        extract_voices(empty)


def test_leftovers_of_a_dead_extraction_are_removed(tmp_path):
    archive = tmp_path / VOICES_ARCHIVE
    archive.write_bytes(voices_tgz())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".voices.tmp-{dead.pid}-abc"
    (stale / "x").mkdir(parents=True)
    alive = tmp_path / f".voices.tmp-{os.getppid()}-def"  # a live process: left alone
    alive.mkdir()
    extract_voices(archive)
    assert not stale.exists()
    assert alive.exists()


# -- finding the model in the cache --------------------------------------------------------------

def test_cached_snapshot_without_network(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFoundError) as caught:
        cached_snapshot(REPO, cache_dir=cache)
    message = caught.value.message
    assert caught.value.exit_code == EXIT_MODEL_MISSING
    assert "is not in the local Hugging Face cache" in message
    assert "`personaplex download`" in message and "--model DIR" in message
    storage = storage_of(cache, "someone/plex")
    commit = "c" * 40
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in HUB_FILES[:-1]:
        (snapshot / name).write_bytes(b"x")
    # Found through its commit even without refs/main (fetched by commit hash).
    assert cached_snapshot("someone/plex", cache_dir=cache, require=()) == snapshot
    with pytest.raises(ModelNotFoundError, match="missing voices.tgz") as caught:
        cached_snapshot("someone/plex", cache_dir=cache)
    assert "`personaplex download --model someone/plex`" in caught.value.message
    (snapshot / VOICES_ARCHIVE).write_bytes(b"x")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    assert cached_snapshot("someone/plex", cache_dir=cache) == snapshot
    with pytest.raises(ModelNotFoundError, match="revision v2"):
        cached_snapshot("someone/plex", "v2", cache_dir=cache)
    with pytest.raises(ModelNotFoundError, match="not a valid Hugging Face repo id"):
        cached_snapshot("a--b/c", cache_dir=cache)


def test_resolve_model_names_the_download_command_for_a_missing_file(tmp_path):
    cache = tmp_path / "cache"
    snapshot = storage_of(cache) / "snapshots" / ("d" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / MIMI_FILE).write_bytes(b"x")
    (storage_of(cache) / "refs").mkdir()
    (storage_of(cache) / "refs" / "main").write_text("d" * 40)
    code = ("from personaplex_cli.model.files import resolve_model\n"
            "m = resolve_model(None)\nprint(m.mimi_file())\nm.lm_file()")
    env = hub_env(tmp_path, None, HF_HUB_CACHE=cache, HF_HUB_OFFLINE=1)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.splitlines() == [str(snapshot / MIMI_FILE)]
    assert "the language model checkpoint (model.safetensors) is missing from model " \
           "nvidia/personaplex-7b-v1 in the local Hugging Face cache" in proc.stderr
    assert "run `personaplex download` to fetch it, or pass --model DIR" in proc.stderr
