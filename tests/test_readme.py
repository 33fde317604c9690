"""Every example of the README runs as printed, in order, on the tiny model of
`personaplex download --tiny`; the README's memory figures are model/memory.py's count.

The README is read top to bottom as a new user pastes it, in a folder that looks like a clone
(the repository's files linked in), with a HOME of its own:

- Shell lines run one at a time in bash with `set -e -o pipefail`, each in the environment
  the lines before it left (so `export` and `unset` carry on). A `personaplex serve` line
  starts a server, as in a terminal of its own, that stays up until the next `serve` line or
  the end (then SIGTERM: exit 143): the curl lines and the Python clients after it talk to
  it, so one server at its defaults answers every HTTP example. A live `personaplex talk`
  (a microphone and a speaker: the virtual sound device of tests/virtual_audio.py) runs
  until its session is live and has run two seconds, then gets Ctrl-C (exit 130).
- Python blocks run as scripts with this interpreter; the `json` block is the manifest the
  `reply --manifest` line reads, as printed.
- The hub is a local stand-in (tests/hub_server.py) holding the tiny model's files as
  nvidia/personaplex-7b-v1, so `personaplex download` runs as printed. Players, recorders
  and ssh are stood in for (`play`/`aplay` take the audio and drop it, `rec` gives the
  sample question, `ssh HOST CMD` runs CMD here), as is zstd where it is missing.
- The recordings and files an example names that a user brings (calls/, interview.mp3,
  call.m4a, me.wav, cert.pem) are made here; what one example writes, a later one may read.

The lines that cannot run here are listed in NOT_RUN with the reason; a README line that is
neither run nor listed fails the test, and so does a listed line the README no longer has.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cli_forks import WarmInterpreter, shell_command
from conftest import speech_like
from hub_server import HubServer
from virtual_audio import virtual_audio  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SAMPLE = ROOT / "personaplex_cli" / "samples" / "question.wav"
PORT = 8998  # serve's default, which the examples name

NOT_RUN = {
    "python3 -m venv .venv && . .venv/bin/activate":
        "the install: .ci/run installs the project the same way, and the first screen's "
        "install was timed from a clean clone by hand",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install .":
        "the install (as above)",
    "pip install .": "the install (as above)",
    "pip install '.[ray]'": "the install (as above); the Ray extra is in the test command",
    "hf auth login": "interactive: signs a Hugging Face account in",
    "personaplex doctor --bench --quantize int4":
        "builds the 7B at its real dimensions: about 10 GiB and minutes on a CPU "
        "(tests/test_doctor_bench.py runs --bench at the tiny size)",
    "ray job submit --address http://HEAD:8265 -- personaplex reply --manifest "
    "/shared/calls.jsonl --ray auto -m /shared/personaplex-7b-v1":
        "needs a Ray cluster and a filesystem its nodes share (tests/test_ray.py runs "
        "--ray on a local cluster)",
    "pip install torch==2.13.0 && pip install -e '.[test,ray]' && pip install --no-deps "
    "moshi==0.2.13 && python -m pytest -q": "the test suite itself",
}

STAND_INS = {
    "play": "cat > /dev/null",
    "aplay": "cat > /dev/null",
    "rec": f'cat "{SAMPLE}"',
    "ssh": 'shift; exec "$@"',  # ssh HOST CMD...: CMD here
}
STAND_INS_WHEN_MISSING = {"zstd": "cat"}
REAL_TOOLS = ("sox", "ffmpeg", "curl", "openssl")  # .ci/run installs them


def command(line: str) -> str:
    """A shell line without its trailing comment (two spaces, then #)."""
    return line.split("  #")[0].strip()


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order; indented blocks (in a list item)
    lose their indentation."""
    found = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```\s*$", text, re.M | re.S):
        indent = len(match.group(1))
        body = "".join(line[indent:] for line in match.group(3).splitlines(keepends=True))
        found.append((match.group(2), body))
    return found


def shell_lines(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.strip()]


def is_serve(line: str) -> bool:
    return re.search(r"(^|\s)personaplex serve\b", command(line)) is not None


def is_live_talk(line: str) -> bool:
    words = command(line).split()
    return (words[:2] == ["personaplex", "talk"]
            and not {"--input", "--output", "--list-devices"} & set(words))


class Background:
    """A server or a live session started from a README line, its stderr collected."""

    def __init__(self, line: str, env: dict, cwd: Path):
        self.line = line
        self.lines: list[str] = []
        self.proc = subprocess.Popen(["bash", "-c", f"set -e -o pipefail\n{line}"], env=env,
                                     cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for text in self.proc.stderr:
            self.lines.append(text.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, text) for text in self.lines):
            if self.proc.poll() is not None:
                self.reader.join(5)
                pytest.fail(f"{self.line!r} ended ({self.proc.returncode}) before "
                            f"{pattern!r}:\n" + "\n".join(self.lines))
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                pytest.fail(f"{self.line!r}: no {pattern!r} in {timeout:.0f} s:\n"
                            + "\n".join(self.lines))
            time.sleep(0.05)

    def stop(self, signum: int) -> int:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass
        code = self.proc.wait(60)
        self.reader.join(5)
        return code


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def write_tools(folder: Path) -> None:
    folder.mkdir()
    chosen = dict(STAND_INS)
    chosen.update({name: body for name, body in STAND_INS_WHEN_MISSING.items()
                   if shutil.which(name) is None})
    for name, body in chosen.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)


def users_files(work: Path, manifest: str) -> None:
    """What the examples name that a user brings: recordings, a manifest, a certificate."""
    (work / "calls").mkdir()
    for name, seconds, seed in (("a", 2.0, 1), ("b", 3.0, 2)):
        sf.write(work / "calls" / f"{name}.wav", speech_like(seconds, seed=seed), 24000,
                 subtype="PCM_16")
    (work / "calls.jsonl").write_text(manifest)
    sf.write(work / "me.wav", speech_like(12.0, seed=3), 24000, subtype="PCM_16")
    shutil.copy(ROOT / "tests" / "data" / "audio" / "speech-22k-mono-cbr.mp3",
                work / "interview.mp3")
    subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-i", str(SAMPLE),
                    str(work / "call.m4a")], check=True, timeout=60)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(work / "key.pem"),
                    "-out", str(work / "cert.pem")], check=True, capture_output=True,
                   timeout=60)


def tiny_hub_files(tmp: Path) -> dict[str, Path]:
    from personaplex_cli.model.files import HUB_FILES
    from personaplex_cli.model.random_model import write_tiny_model

    model = write_tiny_model(tmp / "tiny-for-the-hub").path
    # The real repo has no architecture file: the tiny one needs its own beside its LM.
    return {name: model / name for name in (*HUB_FILES, "personaplex-arch.json")}


def current_env(before: dict, env_file: Path) -> dict:
    values = env_file.read_bytes().split(b"\0")
    env = dict(entry.decode().split("=", 1) for entry in values if b"=" in entry)
    env.pop("_", None)
    env.pop("SHLVL", None)
    env.pop("PWD", None)
    env.pop("OLDPWD", None)
    return env or before


def test_every_readme_example_runs_as_printed(cli_env, virtual_audio, tmp_path):  # noqa: F811
    for tool in REAL_TOOLS:
        assert shutil.which(tool), f"{tool} is not installed (.ci/run installs it)"
    assert port_is_free(PORT), (f"port {PORT} is taken: the README's examples use serve's "
                                "default port")
    started = time.monotonic()
    text = README.read_text(encoding="utf-8")
    found = blocks(text)
    languages = {language for language, _ in found}
    assert languages <= {"sh", "python", "json"}, languages
    manifests = [body for language, body in found if language == "json"]
    assert len(manifests) == 1

    work = tmp_path / "clone"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv") and not entry.name.startswith(".venv"):
            (work / entry.name).symlink_to(entry)
    users_files(work, manifests[0])
    write_tools(tmp_path / "stand-ins")
    home = tmp_path / "home"  # a new user's: no caches, voices or tokens of the suite's
    home.mkdir()
    env_file = tmp_path / "env"
    env = {**cli_env, **virtual_audio.env, "HOME": str(home),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / ".local/share"),
           "HF_HOME": str(home / ".cache" / "huggingface"),
           "PATH": f"{tmp_path / 'stand-ins'}{os.pathsep}{Path(sys.executable).parent}"
                   f"{os.pathsep}{os.environ['PATH']}"}
    env.pop("HF_HUB_OFFLINE")  # the stand-in hub answers `personaplex download`
    # `personaplex` on the PATH runs each command as a fork of an interpreter that has
    # imported torch (tests/cli_forks.py), as run_cli does: most of a tiny run's time.
    warm = WarmInterpreter(env)
    shell_command(warm, tmp_path / "stand-ins")

    listed = [line for _, body in found for line in shell_lines(body) if command(line) in NOT_RUN]
    assert {command(line) for line in listed} == set(NOT_RUN), "NOT_RUN names lines the " \
        "README no longer has"
    ran: list[tuple[str, float]] = []  # each example and the seconds it took
    last = time.monotonic()

    def done(example: str) -> None:
        nonlocal last
        ran.append((example, time.monotonic() - last))
        last = time.monotonic()

    server: Background | None = None
    with HubServer() as hub:
        hub.add_repo("nvidia/personaplex-7b-v1", tiny_hub_files(tmp_path))
        env["HF_ENDPOINT"] = hub.url
        try:
            for language, body in found:
                if language == "json":
                    continue
                if language == "python":
                    script = tmp_path / f"example-{len(ran)}.py"
                    script.write_text(body)
                    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=work,
                                          stdin=subprocess.DEVNULL, capture_output=True,
                                          timeout=180)
                    assert proc.returncode == 0, (body, proc.stderr.decode())
                    done(body)
                    continue
                for line in shell_lines(body):
                    if command(line) in NOT_RUN:
                        continue
                    if is_serve(line):
                        if server is not None:
                            assert server.stop(signal.SIGTERM) == 143, server.lines
                        server = Background(line, env, work)
                        server.wait_for(r"^listening on ", 180)
                    elif is_live_talk(line):
                        talk = Background(line, env, work)
                        talk.wait_for(r"^warm-up: ", 180)
                        time.sleep(2)
                        code = talk.stop(signal.SIGINT)
                        assert code == 130, (line, talk.lines)
                        assert not [t for t in talk.lines if "error" in t], talk.lines
                    else:
                        proc = subprocess.run(
                            ["bash", "-c", f"set -e -o pipefail\n{line}\n"
                                           f"env -0 > {env_file}"],
                            env=env, cwd=work, stdin=subprocess.DEVNULL, capture_output=True,
                            timeout=180)
                        assert proc.returncode == 0, (line, proc.stderr.decode())
                        assert b"Traceback" not in proc.stderr, (line, proc.stderr.decode())
                        env = current_env(env, env_file)
                    done(line)
        finally:
            if server is not None:
                assert server.stop(signal.SIGTERM) == 143, server.lines
            warm.close()

    # Each kind of example did its work, on the tiny model.
    assert env.get("PERSONAPLEX_MODEL") is None  # the guide unset it for the real model
    for made in ("answer.wav", "answer.txt", "reply.wav", "bakery.flac", "finished.srt", "finished.mimi",
                 "replies/a.wav", "replies/a.srt", "out/a.wav", "out/b.wav", "call.wav",
                 "call.txt", "talked.wav", "http-answer.wav", "chat-answer.wav",
                 "realtime-answer.pcm", "question.mimi", "question.decoded.wav",
                 "roundtrip.wav", "question.mimi.zst", "question.flac", "codes.npy",
                 "over-ssh.wav", "call-answer.srt"):
        assert (work / made).stat().st_size > 0, made
    assert sf.info(work / "http-answer.wav").duration == pytest.approx(
        sf.info(SAMPLE).duration + 3, abs=0.01)
    pcm = np.frombuffer((work / "realtime-answer.pcm").read_bytes(), "<i2")
    assert len(pcm) >= 24000 and len(pcm) % 1920 == 0  # whole 80 ms frames, a second or more
    print(f"{len(ran)} README examples ran in {time.monotonic() - started:.0f} s; the slowest:")
    for example, seconds in sorted(ran, key=lambda item: -item[1])[:8]:
        print(f"  {seconds:5.1f} s  {example.splitlines()[0][:90]}")


def _gib(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"(\d+(?:\.\d+)?) GiB", text)]


def test_the_memory_figures_are_the_count():
    """The GPU line of the README's first screen and docs/memory.md's tables say what
    model/memory.py counts for one stream of the 7B."""
    from personaplex_cli.model.memory import GIB, personaplex_need

    def total(device: str, quantize: str, dtype: str = "bf16") -> float:
        return round(personaplex_need(dtype, quantize, 1, device).total / GIB, 1)

    gpu_line = next(line for line in README.read_text().splitlines()
                    if line.startswith("- **NVIDIA GPU:**"))
    gpu_line += " " + README.read_text().split(gpu_line, 1)[1].split("\n")[1]
    assert _gib(gpu_line) == [total("cuda", "none"), total("cuda", "int8"),
                              total("cuda", "int4")], gpu_line

    memory = (ROOT / "docs" / "memory.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in memory.splitlines()
            if line.startswith(("| CUDA |", "| CPU |"))}
    for device, row in (("cuda", rows["CUDA"]), ("cpu", rows["CPU"])):
        cells = [cell.strip() for cell in row.split("|")[2:-1]]
        expected = [total(device, "none"), total(device, "int8"), total(device, "int4"),
                    total(device, "fp8") if device == "cuda" else None,
                    total(device, "none", "fp32")]
        got = [float(cell) if cell[0].isdigit() else None for cell in cells]
        assert got == expected, (device, row)
    need = personaplex_need("bf16", "none", 1, "cuda")
    parts = next(line for line in memory.splitlines() if line.startswith("| KV window |"))
    assert f"{need.kv_per_stream / GIB:.2f} GiB at bf16" in parts
    assert f"{personaplex_need('fp32', 'none', 1, 'cuda').kv_per_stream / GIB:.2f} GiB at " \
           "fp32" in parts
    weights = next(line for line in memory.splitlines() if line.startswith("| LM weights |"))
    for dtype, quantize, name in (("bf16", "none", "bf16 or fp16"), ("bf16", "int8", "int8"),
                                  ("bf16", "fp8", "fp8"), ("bf16", "int4", "int4"),
                                  ("fp32", "none", "fp32")):
        value = personaplex_need(dtype, quantize, 1, "cuda").weights / GIB
        assert f"{name} {value:.2f} GiB" in weights, (name, value, weights)
