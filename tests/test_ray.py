"""Past one machine on Ray, on a local cluster of this machine only (127.0.0.1, 2 CPUs):
`reply --manifest --ray` (Ray Data workers) and `serve --ray` (Ray Serve replicas).

Ray starts slowly on a small shared machine, so this module starts one cluster, in this
process, for all its tests; the commands under test join it as separate processes, as
they would join a real cluster (`--ray HOST:PORT`). The processes a test kills are found
among this process's descendants only (the cluster's workers), never by name.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import GOLDEN_ASSETS, golden_model_folder, speech_like
from personaplex_cli import errors

SEED = 10
BATCH = "4"


@pytest.fixture(scope="module")
def cluster():
    """The address of a Ray cluster of 2 CPUs on 127.0.0.1, started by this process, with
    a token of its own (Ray keeps one in ~/.ray, which another cluster on this machine
    may replace)."""
    import secrets
    import tempfile

    # Ray's one-machine mode, which binds to the loopback (ray_cluster.import_ray: before Ray
    # is imported), and its token for the commands that join it; both undone after.
    ours = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ours.items():
            patch.setenv(name, value)
        ray = pytest.importorskip("ray")
        # Ray's socket paths must be short: not under pytest's deep temporary folders.
        temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:"), address
        yield Cluster(address, ours)
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


class Cluster(str):
    """The address (a str), and the environment a command joining it needs."""

    def __new__(cls, address: str, env: dict[str, str]):
        self = super().__new__(cls, address)
        self.env = env
        return self


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A model folder and a 12-row manifest of mixed personas (a packaged .pt voice, a
    recording relative to the manifest, no voice, a role alone), of several lengths, some
    rows with their text and codes, with the local run's outputs as the reference."""
    root = tmp_path_factory.mktemp("ray")
    model = golden_model_folder(root / "model")
    (root / "voices").mkdir()
    (root / "voices" / "me.wav").write_bytes((GOLDEN_ASSETS / "voice_prompt.wav").read_bytes())
    personas = [{"voice": "NATF2"}, {"voice": "voices/me.wav", "prompt": "You are a pirate."},
                {"voice": ""}, {"prompt": "Be brief."}]
    rows = []
    (root / "in").mkdir()
    for i in range(12):
        sf.write(root / "in" / f"{i}.wav", speech_like(1.0 + 0.4 * (i % 5), 24000, i), 24000,
                 subtype="PCM_16")
        row = {"input": f"in/{i}.wav", "output": f"{{out}}/{i}.wav", **personas[i % 4]}
        if i % 3 == 0:
            row.update(text_out="json", codes_out=f"{{out}}/{i}.mimi")
        rows.append(row)
    return Work(root, model, rows)


@pytest.fixture(scope="module")
def long_work(work):
    """The same manifest with inputs four to fourteen times as long, for a test that must
    kill a worker while it still has rows to answer: after its first row ends, its queued
    rows take seconds, not the tenths of a second the driver may take to print that first
    line."""
    for i in range(12):
        sf.write(work.root / "in" / f"long{i}.wav", speech_like(4 + 2 * (i % 5), 24000, i),
                 24000, subtype="PCM_16")
    return Work(work.root, work.model, [{**row, "input": f"in/long{i}.wav"}
                                        for i, row in enumerate(work.rows)], name="long")


class Work:
    def __init__(self, root: Path, model: Path, rows: list[dict], name: str = ""):
        self.root, self.model, self.rows, self.name = root, model, rows, name
        self._reference: dict[str, bytes] | None = None

    def manifest(self, out: str) -> Path:
        """The manifest with its outputs in `out` (a folder of root, or a URL)."""
        if "://" not in out:
            (self.root / out).mkdir(exist_ok=True)
        path = self.root / f"{out.replace('/', '_').replace(':', '_')}.jsonl"
        path.write_text("".join(json.dumps({k: v.replace("{out}", out) for k, v in row.items()})
                                + "\n" for row in self.rows))
        return path

    def outputs(self, out: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    def reference(self, run) -> dict[str, bytes]:
        """The outputs of the same manifest answered here, without Ray."""
        if self._reference is None:
            proc = run("--manifest", self.manifest(self.name + "local"))
            assert proc.returncode == 0, proc.stderr.decode()
            self._reference = self.outputs(self.root / (self.name + "local"))
            assert len(self._reference) == 12 + 2 * 4  # 4 rows have text and codes
        return self._reference


@pytest.fixture(scope="module")
def reply(cli_env, run_cli, work, cluster):
    env = {**cli_env, **cluster.env, "PERSONAPLEX_MODEL": str(work.model),
           "PERSONAPLEX_DEVICE": "cpu"}

    def run(*args):
        # A fork of the warm interpreter, which has imported torch but never Ray: the
        # driver joins the cluster as a fresh one would.
        return run_cli("reply", *args, "--seed", SEED, "-b", BATCH, env=env, cwd=work.root,
                       timeout=600)

    def start(*args):
        return subprocess.Popen([sys.executable, "-m", "personaplex_cli", "reply",
                                 *map(str, args), "--seed", str(SEED), "-b", BATCH],
                                env=env, cwd=work.root, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE,
                                # Unbuffered: communicate() reads the pipe itself, so a
                                # line a buffered readline() had taken past would be lost.
                                bufsize=0)

    run.start = start
    return run


def statuses(stdout: bytes) -> list[dict]:
    return [json.loads(line) for line in stdout.decode().splitlines()]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), so a test kills only what it started."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def no_parts_left(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".part")]


# -- reply --manifest --ray -------------------------------------------------------------------

def test_a_manifest_on_two_workers_equals_the_local_run(cluster, work, reply):
    """12 rows with mixed personas on 2 workers: every output (reply, text, codes; some at
    a file:// URL) is the bytes of the local run, the rows are shared by both workers, and
    each row gets one JSON line."""
    reference = work.reference(reply)
    url = (work.root / "url").as_uri()
    proc = reply("--manifest", work.manifest(url), "--ray", cluster, "--workers", "2",
                 "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    lines = statuses(proc.stdout)
    assert sorted(line["where"].rsplit(":", 1)[1] for line in lines) == sorted(
        str(i) for i in range(1, 13))
    assert {line["status"] for line in lines} == {"done"}
    assert len({line["worker"] for line in lines}) == 2
    assert work.outputs(work.root / "url") == reference


def test_a_killed_worker_has_its_rows_answered_again(cluster, long_work, reply):
    """SIGKILL to the worker that answered the first row: Ray restarts it and reruns its
    rows; every row is answered once, equal to the local run, and no partial file stays."""
    work = long_work
    reference = work.reference(reply)
    proc = reply.start("--manifest", work.manifest("killed"), "--ray", cluster,
                       "--workers", "2", "--json")
    first = json.loads(proc.stdout.readline() or proc.communicate()[1])
    victim = int(first["worker"].rsplit(":", 1)[1])
    assert victim in descendants(os.getpid())  # one of this cluster's workers
    os.kill(victim, signal.SIGKILL)
    rest, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr.decode()
    lines = [first] + statuses(rest)
    assert sorted(line["where"] for line in lines) == sorted(
        {line["where"] for line in lines})  # once each
    assert len(lines) == 12 and {line["status"] for line in lines} == {"done"}
    # Each worker's task held 6 rows: the killed one's unfinished rows went elsewhere.
    assert sum(line.get("worker") == first["worker"] for line in lines) < 6
    assert work.outputs(work.root / "killed") == reference
    no_parts_left(work.root / "killed")


def test_skip_existing_finishes_an_interrupted_run(cluster, work, reply):
    """The command killed outright after its first row: a rerun with --skip-existing
    leaves the finished rows alone and answers the rest, equal to the local run."""
    reference = work.reference(reply)
    manifest = work.manifest("resumed")
    proc = reply.start("--manifest", manifest, "--ray", cluster, "--workers", "2", "--json")
    assert json.loads(proc.stdout.readline() or proc.communicate()[1])["status"] == "done"
    proc.kill()
    proc.communicate()
    finished = [p for p in (work.root / "resumed").glob("*.wav")]
    assert 1 <= len(finished) < 12
    proc = reply("--manifest", manifest, "--ray", cluster, "--workers", "2", "--json",
                 "--skip-existing")
    assert proc.returncode == 0, proc.stderr.decode()
    lines = statuses(proc.stdout)
    skipped = sum(line["status"] == "skipped" for line in lines)
    assert skipped >= len(finished) and skipped + sum(
        line["status"] == "done" for line in lines) == 12
    assert work.outputs(work.root / "resumed") == reference
    no_parts_left(work.root / "resumed")


def test_ray_refusals(cluster, work, reply, tmp_path):
    """A bad row stops a --ray run before it starts, with its line, as on one machine;
    --keep-going answers the others on the cluster and lists it; --ray wants a manifest."""
    rows = [{"input": str(work.root / "in" / "0.wav"), "output": str(tmp_path / "a.wav")},
            {"input": str(work.root / "in" / "missing.wav"), "output": str(tmp_path / "b.wav")}]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = reply("--manifest", manifest, "--ray", cluster)
    assert proc.returncode == errors.EXIT_BAD_INPUT
    assert "m.jsonl:2" in proc.stderr.decode() and "missing.wav" in proc.stderr.decode()
    assert len(proc.stderr.decode().strip().splitlines()) == 1
    proc = reply("--manifest", manifest, "--ray", cluster, "--keep-going", "--json")
    assert proc.returncode == errors.EXIT_BAD_INPUT, proc.stderr.decode()
    assert sorted(line["status"] for line in statuses(proc.stdout)) == ["done", "failed"]
    assert (tmp_path / "a.wav").exists() and not (tmp_path / "b.wav").exists()
    proc = reply("in/0.wav", tmp_path / "c.wav", "--ray", cluster)
    assert proc.returncode == errors.EXIT_USAGE and "--manifest" in proc.stderr.decode()
    # The workers hold to --max-prime-s: a row whose role prompt would prime longer fails
    # with the figure, as on one machine, and writes nothing.
    prompted = tmp_path / "prompted.jsonl"
    prompted.write_text(json.dumps({**rows[0], "output": str(tmp_path / "p.wav"),
                                    "prompt": "Answer in French."}) + "\n")
    proc = reply("--manifest", prompted, "--ray", cluster, "--max-prime-s", "1e-6")
    assert proc.returncode == errors.EXIT_BAD_INPUT, proc.stderr.decode()
    assert "--max-prime-s 1e-06 allows 0 tokens" in proc.stderr.decode()
    assert not (tmp_path / "p.wav").exists()
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there: refused at once
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(rows[0]) + "\n")
    proc = reply("--manifest", good, "--ray", nowhere, "--force")
    assert proc.returncode == errors.EXIT_CLUSTER, proc.stderr.decode()
    assert proc.stderr.decode().strip().splitlines() == [
        f"personaplex: error: cannot join the Ray cluster at {nowhere}: Connection refused"]


_WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # as on the default install: `import ray` fails
from personaplex_cli.cli.app import main
sys.argv = ["personaplex", *sys.argv[1:]]
main()
"""


def test_without_ray_it_says_how_to_get_it(cli_env, tmp_path):
    """--ray on the default install (reply and serve): one line naming the extra, exit 9,
    nothing read nor loaded; --workers and --replicas want --ray."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"input": "in.wav", "output": "out.wav"}) + "\n")
    for command in (["reply", "--manifest", str(manifest), "--ray", "local"],
                    ["serve", "--ray", "local", "-m", str(tmp_path / "no-model")]):
        proc = subprocess.run([sys.executable, "-c", _WITHOUT_RAY, *command], env=cli_env,
                              cwd=tmp_path, capture_output=True, timeout=60)
        assert proc.returncode == errors.EXIT_CLUSTER == 9, command
        message = proc.stderr.decode().strip()
        assert len(message.splitlines()) == 1 and "personaplex-cli[ray]" in message, message
    assert list(tmp_path.iterdir()) == [manifest]
    for command, option in ((["reply", "--manifest", str(manifest), "--workers", "2"],
                             "--workers"), (["serve", "--replicas", "2"], "--replicas")):
        proc = subprocess.run([sys.executable, "-c", _WITHOUT_RAY, *command], env=cli_env,
                              cwd=tmp_path, capture_output=True, timeout=60)
        assert proc.returncode == errors.EXIT_USAGE and option in proc.stderr.decode()


# -- serve --ray ------------------------------------------------------------------------------

SLOTS = 2  # per replica


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_says_why_its_replicas_would_not_start(cluster, work, cli_env, run_cli):
    """Each replica holds to --max-prime-s: the server's own role prompt over it stops the
    replicas at their start, and `serve --ray` with that one machine's line and exit
    status, not Serve's "deployment failed" (run before `served` takes the cluster's CPUs
    and the engines' names)."""
    env = {**cli_env, **cluster.env, "PERSONAPLEX_MODEL": str(work.model),
           "PERSONAPLEX_DEVICE": "cpu"}
    proc = run_cli("serve", "--ray", cluster, "--replicas", "1", "--port", free_port(),
                   "--prompt", "Answer in French.", "--max-prime-s", "1e-6", env=env,
                   cwd=work.root, timeout=600)
    stderr = proc.stderr.decode()
    assert proc.returncode == errors.EXIT_BAD_INPUT, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("personaplex: error: --prompt: the role prompt is "), stderr
    assert "--max-prime-s 1e-06 allows 0 tokens" in last


@pytest.fixture(scope="module")
def served(cluster, work, cli_env):
    """`personaplex serve --ray` on the cluster: 2 replicas of 2 slots each, on a CPU each,
    behind Serve's proxy on a free port of 127.0.0.1; its stderr lines as they come."""
    import threading

    port = free_port()
    env = {**cli_env, **cluster.env, "PERSONAPLEX_MODEL": str(work.model),
           "PERSONAPLEX_DEVICE": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "personaplex_cli", "serve", "--ray", cluster,
                             "--replicas", "2", "--max-sessions", str(SLOTS), "--port",
                             str(port), "--voice", "NATF2", "--prompt", "Be brief.",
                             "--idle-timeout", "10", "--max-per-client", "0"],
                            env=env, cwd=work.root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:
        for raw in proc.stderr:
            lines.append(raw.decode(errors="replace").rstrip())
            if "listening on" in lines[-1]:
                listening.set()
        listening.set()

    threading.Thread(target=read, daemon=True).start()
    assert listening.wait(600) and proc.poll() is None, "\n".join(lines)
    yield RayServed(f"http://127.0.0.1:{port}", proc, lines)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == errors.EXIT_INTERRUPTED, "\n".join(lines)


class RayServed:
    def __init__(self, url: str, proc, lines: list[str]):
        self.url, self.proc, self.lines = url, proc, lines
        self.ws = "ws" + url[4:] + "/api/chat"

    def get(self, path: str) -> bytes:
        import urllib.request

        with urllib.request.urlopen(self.url + path, timeout=30) as answer:
            return answer.read()

    def health(self) -> dict:
        return json.loads(self.get("/api/health"))

    def taken(self) -> list[int]:
        return [replica["taken"] for replica in self.health()["replicas"]]


def callers(served: RayServed, seconds: list[float], handshakes):
    """One caller per entry of `seconds`, with that much speech, each setting its
    handshakes[i] event."""
    from serve_clients import call, speech

    return [call(served.ws, speech(length, seed=i), on_handshake=handshakes[i].set,
                 linger_s=1.0) for i, length in enumerate(seconds)]


def test_serve_admits_callers_to_a_replica_with_a_free_slot(served):
    """Two replicas of two slots: the first two callers take the first replica, the next
    two the second; a fifth gets the refusal of one machine, counting every slot; the
    health and the metrics cover both replicas."""
    import asyncio

    from serve_clients import call, speech

    health = served.health()
    assert health["status"] == "ok" and health["slots"] == 2 * SLOTS
    assert [r["status"] for r in health["replicas"]] == ["ok", "ok"]

    async def scenario():
        loop = asyncio.get_running_loop()
        handshakes = [asyncio.Event() for _ in range(4)]
        # The first two must still be talking when the last two and the refused one call,
        # however long the last two take to prime on a loaded machine.
        calls = callers(served, [15.0, 15.0, 6.0, 6.0], handshakes)
        first = [asyncio.ensure_future(c) for c in calls[:2]]
        await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handshakes[:2])), 120)
        on_first = await loop.run_in_executor(None, served.taken)
        rest = [asyncio.ensure_future(c) for c in calls[2:]]
        await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handshakes[2:])), 120)
        on_both = await loop.run_in_executor(None, served.taken)
        refused = await call(served.ws, speech(1.0))
        metrics = (await loop.run_in_executor(None, served.get, "/metrics")).decode()
        return on_first, on_both, refused, metrics, await asyncio.gather(*first, *rest)

    on_first, on_both, refused, metrics, answered = asyncio.run(scenario())
    assert on_first == [2, 0] and on_both == [2, 2]
    assert refused.errors == [f"all {2 * SLOTS} conversation slots are taken: try again later"]
    assert refused.close_code == 1013 and refused.handshake_s is None
    assert all(len(got.pages) > 10 and not got.errors for got in answered)
    for replica in ("0", "1"):
        assert f'personaplex_slots{{replica="{replica}",state="total"}} {SLOTS}' in metrics
    assert 'personaplex_replicas{state="up"} 2' in metrics
    assert 'personaplex_ingress_refused_total{reason="full"} 1' in metrics


def test_openai_chat_is_relayed_to_a_replica(served, work):
    """The ingress relays OpenAI's routes: GET /v1/models, and POST /v1/chat/completions
    through the openai SDK, whole and streamed; the stream's frames are the whole answer
    (the same seed on either replica), and the slot is given back after each."""
    import base64
    import io

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                           timeout=300)
    assert [model.id for model in client.models.list()] == ["personaplex-7b-v1",
                                                           "personaplex"]
    recording = (work.root / "in" / "3.wav").read_bytes()
    ask = dict(model="personaplex", modalities=["text", "audio"], seed=SEED,
               messages=[{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "input_audio", "input_audio": {
                             "data": base64.b64encode(recording).decode(),
                             "format": "wav"}}]}])
    whole = client.chat.completions.create(audio={"voice": "NATF2", "format": "pcm16"},
                                           **ask)
    pcm = base64.b64decode(whole.choices[0].message.audio.data)
    streamed = b"".join(
        base64.b64decode(chunk.choices[0].delta.audio.data)
        for chunk in client.chat.completions.create(
            audio={"voice": "NATF2", "format": "pcm16"}, stream=True, **ask)
        if chunk.choices and chunk.choices[0].delta.audio
        and chunk.choices[0].delta.audio.data)
    assert len(pcm) == 2 * len(sf.read(io.BytesIO(recording))[0]) and streamed == pcm
    assert whole.choices[0].message.audio.transcript is not None
    assert served.taken() == [0, 0]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**{**ask, "model": "gpt-4o"})
    # Over the size limit by its Content-Length: refused by the ingress, its body unread.
    import http.client

    from personaplex_cli.serve.switchboard import MAX_REPLY_BYTES

    host, port = served.url[len("http://"):].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Content-Length", str(MAX_REPLY_BYTES + 1))
    connection.endheaders()
    answer = connection.getresponse()
    assert answer.status == 413 and "over the limit" in json.loads(answer.read())[
        "error"]["message"]
    connection.close()


def test_openai_realtime_is_relayed_to_a_replica(served):
    """The ingress relays /v1/realtime as it relays /api/chat: the openai SDK's realtime
    client holds a call through it (its session primed, the caller's audio stepped, the
    model's events back), in a slot of one replica, given back when it hangs up."""
    import asyncio
    import base64

    openai = pytest.importorskip("openai")
    from personaplex_cli.serve import app

    if not hasattr(app, "realtime_endpoint"):
        pytest.skip("this tree's serve has no /v1/realtime yet (the Realtime slice's)")

    async def call():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
        events, taken = [], None
        async with client.realtime.connect(model="personaplex") as connection:
            await connection.session.update(session={"type": "realtime",
                                                     "instructions": "Be brief."})
            async for event in connection:
                events.append(event.type)
                if event.type in ("session.updated", "error"):
                    break
            taken = await asyncio.get_running_loop().run_in_executor(None, served.taken)
            pcm = (np.clip(speech_like(2.0, 24000, 5), -1, 1) * 32767).astype("<i2")
            for k in range(0, len(pcm), 1920):
                await connection.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[k:k + 1920].tobytes()).decode())
                await asyncio.sleep(0.08)
            await connection.input_audio_buffer.commit()
            async for event in connection:
                events.append(event.type)
                if event.type == "input_audio_buffer.committed":
                    break
        return events, taken

    events, taken = asyncio.run(asyncio.wait_for(call(), 300))
    assert events[0] == "session.created" and "session.updated" in events, events
    assert "input_audio_buffer.committed" in events and "error" not in events, events
    assert sorted(taken) == [0, 1]
    deadline = time.monotonic() + 10
    while served.taken() != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served.taken() == [0, 0]


def test_the_ingress_guards_as_one_machine_does(served, work):
    """What one machine's server refuses, the ingress refuses: a Host that names another
    site (421); the replicas, which Serve's proxy also routes to, answer nothing that did
    not come through the ingress; POST /api/reply is relayed to a free slot with its query,
    and the slot given back."""
    import asyncio
    import http.client

    import websockets

    host, port = served.url[len("http://"):].split(":")

    def request(method: str, path: str, headers: dict | None = None, body: bytes = b""):
        connection = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            answer = connection.getresponse()
            return answer.status, answer.read()
        finally:
            connection.close()

    status, body = request("GET", "/api/health", {"Host": "evil.example"})
    assert status == 421 and b"--allow-host" in body
    assert request("GET", "/api/health")[0] == 200
    for path in ("/api/health", "/api/voices", "/v1/models"):  # past the ingress: nothing
        assert request("GET", "/personaplex-engine-0" + path)[0] == 404, path

    async def straight_to_a_replica() -> None:
        async with websockets.connect(f"ws://{host}:{port}/personaplex-engine-1/api/chat",
                                      open_timeout=30) as socket:
            await socket.recv()

    with pytest.raises((websockets.InvalidStatus, websockets.ConnectionClosed)):
        asyncio.run(straight_to_a_replica())
    recording = (work.root / "in" / "2.wav").read_bytes()
    status, answer = request("POST", "/api/reply?voice_prompt=NATF2&greedy=1",
                             {"Content-Type": "audio/wav"}, recording)
    assert status == 200, answer
    assert len(sf.read(io.BytesIO(answer))[0]) == len(sf.read(io.BytesIO(recording))[0])
    status, answer = request("POST", "/api/reply?voice_prompt=NOBODY", {}, recording)
    assert status == 400 and b"NOBODY" in answer  # the replica's refusal, relayed in words
    assert served.taken() == [0, 0]


def test_a_killed_replica_ends_its_sessions_and_new_callers_go_to_the_other(served):
    """SIGKILL to the first replica's process while it holds two sessions and the second
    holds one: its callers get a 0x05 message and a close (1011), the other's call goes
    on, and a new caller is answered by the second replica."""
    import asyncio

    from personaplex_cli.cluster.serving import LOST

    health = served.health()
    victim = health["replicas"][0]["pid"]
    assert victim in descendants(os.getpid())  # a process of this cluster

    async def scenario():
        loop = asyncio.get_running_loop()
        handshakes = [asyncio.Event() for _ in range(4)]
        # The victim's callers have more speech than the test can take to notice the kill
        # (on a loaded machine the third handshake can come seconds after the first): a
        # call that ends on its own before the kill is seen would prove nothing. The third
        # must still be talking when the newcomer has primed beside it.
        calls = callers(served, [120.0, 120.0, 30.0, 8.0], handshakes)
        held = [asyncio.ensure_future(c) for c in calls[:3]]
        await asyncio.wait_for(asyncio.gather(*(h.wait() for h in handshakes[:3])), 120)
        before = await loop.run_in_executor(None, served.taken)
        os.kill(victim, signal.SIGKILL)
        ended = await asyncio.wait_for(asyncio.gather(*held[:2]), 60)
        newcomer = asyncio.ensure_future(calls[3])
        await asyncio.wait_for(handshakes[3].wait(), 120)
        during = await loop.run_in_executor(None, served.health)
        return before, ended, during, await held[2], await newcomer

    before, ended, during, kept, newcomer = asyncio.run(scenario())
    assert before == [2, 1]
    for got in ended:
        assert got.errors == [LOST] and got.close_code == 1011
    assert during["replicas"][0]["status"] == "down"
    assert during["replicas"][1]["taken"] == 2
    assert not kept.errors and len(kept.pages) > 50
    assert not newcomer.errors and len(newcomer.pages) > 50
