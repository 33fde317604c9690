"""Every bad input of every command, in one table (issue 9, section 4).

Each case runs the real console script (`python -m personaplex_cli`) in a subprocess, in the
isolated environment of conftest's `run_cli`, with its own folder as the working directory,
and checks what a user would see:

- the documented exit status (personaplex_cli/errors.py);
- one line on stderr, `personaplex: error: ...` (a usage error may add the one line
  `Try 'personaplex X -h' for help.`), saying what went wrong (`says`), and no traceback;
- nothing on stdout;
- no file left behind and no input changed: the case's folder (inputs, model copies,
  caches pointed into it, hidden `.part` temporaries) is the same before and after, byte
  for byte.

A few inputs that look hostile are legitimate (8 channels at 192 kHz, a voices.tgz in a
fresh cache, `talk --list-devices` without a model): those cases expect success, check the
output, and allow only the new paths they name (`makes`).

The models: encode and decode run on the tiny random Mimi of conftest's `tiny_model_dir`;
reply, voices and talk on the golden tiny checkpoints (tests/data/golden/assets), laid out
as test_reply.py's `model_folder()` does (`golden_model` below). Reply cases give a short
role prompt so that the persona fits the tiny model's 64-frame context (the default prompt
with the default voice does not, and reply would warn about it on stderr). Download cases
run with -q (download narrates its progress on stderr by design; -q is "errors only")
against local hub servers (tests/hub_server.py).

Each run costs seconds of interpreter and torch start-up, so the cases chosen for this
session are started together in a pool of two workers when the module's first test asks
for them; each test then waits for its own (`pytest -k` starts only the chosen ones).
Cases that do not apply on this machine (root writes anywhere, CUDA present, no tmpfs, no
PortAudio) are skipped with the reason.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import math
import os
import pty
import re
import shutil
import stat
import struct
import subprocess
import tarfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import SAMPLE_RATE, mimi_with_header, speech_like
from hub_server import HubServer, closed_port, tgz
from personaplex_cli import errors
from personaplex_cli.model.files import LM_FILE, MIMI_FILE, TOKENIZER_FILE, VOICES_ARCHIVE

ASSETS = Path(__file__).parent / "data" / "golden" / "assets"
WORKERS = 2  # the machine is shared: never more than two CLI runs at once
SHORT_PROMPT = "Answer briefly."  # fits the tiny model's context with the NATF2 voice
NOT_A_VOICE = "is not a voice file (.pt with embeddings and cache)"
HINT = re.compile(r"^Try 'personaplex( [a-z]+)* -h' for help\.$")
PYTHON_EXCEPTION = re.compile(r"\b[A-Z]\w*(Error|Exception)\b")
ONE_HOUR = 3600


# -- what a case is ---------------------------------------------------------------------------

@dataclass
class Case:
    args: list
    code: int
    says: str = ""  # a piece of the one error line
    stdin: bytes | None = None
    env: dict = field(default_factory=dict)
    tty: str | None = None  # "stdin" or "stdout": a pseudo-terminal there; "open-stdin": a
    # pipe that never ends (a command that reads it before refusing would hang, not pass)
    makes: tuple[str, ...] = ()  # success only: new paths allowed (relative to the folder)
    check: Callable[[Path, subprocess.CompletedProcess], None] | None = None  # success only
    after: Callable[[], None] | None = None  # more checks, outside the case's folder


@dataclass
class Shared:
    """What the builders draw on: made once for the module."""

    root: Path
    speech_wav: Path  # 1.5 s of speech-like audio, 24 kHz mono s16 (36000 samples)
    mimi: bytes  # speech_wav encoded with the tiny Mimi
    tiny: Path  # the Mimi-only random model
    golden: Path  # the golden tiny checkpoints as a model folder
    hubs: dict[str, HubServer] = field(default_factory=dict)
    cleanups: list[Callable[[], None]] = field(default_factory=list)


class Ctx:
    """One case's folder, and shorthands for its inputs and commands."""

    def __init__(self, work: Path, shared: Shared):
        self.work = work
        self.shared = shared
        self.out = work / "out"
        self.out.mkdir()

    # inputs, all inside the folder (so the snapshot sees that they stay as they were)
    def file(self, name: str, data: bytes) -> Path:
        path = self.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def speech(self, name: str = "speech.wav") -> Path:
        return self.file(name, self.shared.speech_wav.read_bytes())

    def wav(self, name: str, x: np.ndarray, rate: int = SAMPLE_RATE,
            subtype: str = "PCM_16") -> Path:
        return self.file(name, _wav_bytes(x, rate, subtype))

    def codes(self, name: str = "speech.mimi", data: bytes | None = None) -> Path:
        return self.file(name, self.shared.mimi if data is None else data)

    def golden_model(self, name: str = "model", **kwargs) -> Path:
        return golden_model(self.work / name, **kwargs)

    def tiny_copy(self, name: str = "model", with_mimi: bool = True) -> Path:
        folder = self.work / name
        folder.mkdir()
        for path in self.shared.tiny.iterdir():
            if with_mimi or not path.name.startswith("tokenizer-"):
                shutil.copy(path, folder / path.name)
        return folder

    # commands: encode/decode on the tiny Mimi, the others on the golden checkpoints
    def encode(self, *args, code: int, says: str, **kwargs) -> Case:
        return self._case("encode", args, code, says, self.shared.tiny, **kwargs)

    def decode(self, *args, code: int, says: str, **kwargs) -> Case:
        return self._case("decode", args, code, says, self.shared.tiny, **kwargs)

    def reply(self, *args, code: int, says: str, prompt: bool = True, **kwargs) -> Case:
        extra = ["-p", SHORT_PROMPT] if prompt else []
        return self._case("reply", (*args, *extra), code, says, self.shared.golden, **kwargs)

    def voices(self, *args, code: int, says: str, **kwargs) -> Case:
        return self._case("voices", args, code, says, self.shared.golden, **kwargs)

    def talk(self, *args, code: int, says: str, **kwargs) -> Case:
        return self._case("talk", args, code, says, self.shared.golden, **kwargs)

    def download(self, *args, code: int, says: str, hub: str | None = "main",
                 cache: Path | None = None, **kwargs) -> Case:
        env = {"HF_HUB_CACHE": cache or self.work / "hub-cache",
               "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
        if hub is not None:  # online, against a local hub
            env.update({"HF_HUB_OFFLINE": None, "HF_ENDPOINT": self.shared.hubs[hub].url})
        env.update(kwargs.pop("env", {}))
        return Case(["download", "-q", *args], code, says, env=env, **kwargs)

    def usage(self, *args, says: str, **kwargs) -> Case:
        # With a model at hand, a usage check that regressed shows what the run does then.
        model = self.shared.tiny if args[0] in ("encode", "decode") else self.shared.golden
        env = {"PERSONAPLEX_MODEL": model, **kwargs.pop("env", {})}
        return Case(list(args), errors.EXIT_USAGE, says, env=env, **kwargs)

    def _case(self, command, args, code, says, model, env=None, **kwargs) -> Case:
        return Case([*command.split(), *args], code, says,
                    env={"PERSONAPLEX_MODEL": model, **(env or {})}, **kwargs)


# -- inputs -------------------------------------------------------------------------------------

def golden_model(root: Path, voices: bool = True) -> Path:
    """The golden checkpoints as a model folder, the fp32 .pt voice packaged as NATF2 (the
    layout of test_reply.py's `model_folder`)."""
    root.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                 "tokenizer_spm_tiny_512.model"):
        (root / name).symlink_to(ASSETS / name)
    shutil.copy(ASSETS / "personaplex-arch.json", root / "personaplex-arch.json")
    if voices:
        (root / "voices").mkdir()
        shutil.copy(ASSETS / "voice_prompt_fp32.pt", root / "voices" / "NATF2.pt")
    return root


def _wav_bytes(x: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def _nan_wav(seconds: float = 2.0) -> bytes:
    x = speech_like(seconds)
    x[3000] = np.nan
    return _wav_bytes(x, SAMPLE_RATE, "FLOAT")


def _riff_then_noise() -> bytes:
    noise = np.random.default_rng(3).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    return b"RIFF" + struct.pack("<I", 4 + len(noise)) + b"WAVE" + noise


def _one_hour_wav(wav: bytes) -> bytes:
    """A 44-byte-header s16 mono 24 kHz WAV whose header declares one hour over the data
    it really holds: a truncated file (the data ends long before the declared length)."""
    assert wav[36:40] == b"data"
    declared = ONE_HOUR * SAMPLE_RATE * 2
    data = bytearray(wav)
    struct.pack_into("<I", data, 4, 36 + declared)
    struct.pack_into("<I", data, 40, declared)
    return bytes(data)


def _read_to_its_end(output: str) -> Callable[[Path, subprocess.CompletedProcess], None]:
    """The check of a 1.5 s stream whose header declared an hour: one warning, and an
    output (a .mimi or a .wav) of the 1.5 s."""
    def check(work: Path, proc) -> None:
        assert proc.stderr.decode().splitlines() == [
            "personaplex: warning: stdin ends after 1.50 s of the 3600.00 s its WAV header "
            "declares, a length that writers on a pipe can only estimate; using the 1.50 s "
            "it holds"]
        path = work / "out" / output
        if output.endswith(".mimi"):
            assert _parse_mimi(path.read_bytes())[0]["num_samples"] == 36000
        else:
            assert sf.info(path).frames == 36000
    return check


def _one_hour_mimi(data: bytes) -> bytes:
    """A .mimi whose preamble and header declare one hour (45000 frames) over the 1.5 s of
    frames it holds: a truncated code file."""
    data = bytearray(mimi_with_header(data, num_samples=ONE_HOUR * SAMPLE_RATE))
    assert data[5] & 1  # the preamble carries the frame count
    struct.pack_into("<Q", data, 12, ONE_HOUR * 25 // 2)
    return bytes(data)


def _parse_mimi(data: bytes) -> tuple[dict, int, np.ndarray]:
    magic, version, flags, _, json_len, num_frames = struct.unpack_from("<4sBBHIQ", data)
    assert (magic, version) == (b"MIMI", 1) and flags & 1
    header = json.loads(data[20:20 + json_len])
    codes = np.frombuffer(data[20 + json_len:], "<u2").reshape(-1, header["num_codebooks"]).T
    return header, num_frames, codes


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _pickle_bomb(marker: Path, legacy: bool = False) -> bytes:
    """A .pt whose unpickling would run code: it would create `marker`. A zip checkpoint
    (torch's format since 1.6) or, with `legacy`, a bare pickle."""
    import pickle
    import zipfile

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps({"embeddings": Evil(), "cache": Evil()},
                           protocol=4 if legacy else 2)
    if legacy:
        return payload
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("evil/data.pkl", payload)
        archive.writestr("evil/version", "3\n")
    return buf.getvalue()


def _torch_bytes(value) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def _advised_recording() -> bytes:
    """The golden voice recording said five times: 11.5 s of speech, as long as `voices
    create` advises, so that it adds no warning to the error a case is about."""
    pcm, rate = sf.read(ASSETS / "voice_prompt.wav")
    return _wav_bytes(np.tile(pcm, 5), rate)


def _voice_pt() -> bytes:
    return (ASSETS / "voice_prompt_fp32.pt").read_bytes()


def _hub_files(lm_size: int = 300_000, voices: bytes | None = None) -> dict[str, bytes]:
    """A repo the hub serves: random bytes under the file names download fetches."""
    rng = np.random.default_rng(5)
    return {LM_FILE: rng.bytes(lm_size), MIMI_FILE: rng.bytes(120_000),
            TOKENIZER_FILE: rng.bytes(20_000),
            VOICES_ARCHIVE: voices if voices is not None else tgz(
                [("voices", None), ("voices/NATF0.pt", rng.bytes(3000))]),
            "config.json": b'{"model_type": "personaplex"}\n'}


# -- a snapshot of a folder -------------------------------------------------------------------

def snapshot(folder: Path) -> dict[str, tuple]:
    """Every path under `folder` (hidden ones too; links not followed) -> what it is."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            rel = os.path.relpath(path, folder)
            if stat.S_ISLNK(mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(mode):
                found[rel] = ("dir",)
            elif stat.S_ISREG(mode):
                with open(path, "rb") as fh:
                    found[rel] = ("file", hashlib.sha256(fh.read()).hexdigest())
            else:
                found[rel] = ("special", stat.S_IFMT(mode))
    return found


def _differences(before: dict, after: dict) -> dict[str, list[str]]:
    return {"new": sorted(set(after) - set(before)),
            "gone": sorted(set(before) - set(after)),
            "changed": sorted(p for p in before if p in after and before[p] != after[p])}


def _hub_cache_has_no(cache: Path, *names: str) -> Callable[[], None]:
    def check() -> None:
        found = [str(p) for p in cache.rglob("*") if p.name in names] if cache.exists() else []
        assert not found, found
    return check


# -- the cases ----------------------------------------------------------------------------------
# Each builder makes its inputs in the case's folder and returns the Case, or a string: the
# reason it does not apply here (the test is skipped).

def _cuda_reason() -> str | None:
    import torch

    return "CUDA is available here" if torch.cuda.is_available() else None


def _unwritable(c: Ctx) -> Case | str:
    if os.geteuid() == 0:
        return "root writes anywhere (see encode-output-dir-missing)"
    c.out.chmod(0o555)
    c.shared.cleanups.append(lambda: c.out.chmod(0o755))
    return c.encode(c.speech(), "-o", c.out / "x.mimi", code=errors.EXIT_OUTPUT,
                    says="cannot write")


def _wrong_shape_model(c: Ctx) -> Case:
    from safetensors.torch import load_file, save_file

    folder = c.tiny_copy(with_mimi=False)
    checkpoint = next(c.shared.tiny.glob("tokenizer-*.safetensors"))
    tensors = load_file(str(checkpoint))
    name = min(k for k, v in tensors.items() if v.dim() >= 2)
    tensors[name] = tensors[name].new_zeros([n + 1 for n in tensors[name].shape])
    save_file(tensors, str(folder / checkpoint.name))
    return c.encode(c.speech(), "-m", folder, "-o", c.out / "x.mimi",
                    code=errors.EXIT_MODEL_INVALID, says="has shape")


def _unknown_arch_key(c: Ctx) -> Case:
    folder = c.tiny_copy()
    arch = json.loads((folder / "personaplex-arch.json").read_text())
    arch["mimi"]["no_such_setting"] = 1
    (folder / "personaplex-arch.json").write_text(json.dumps(arch))
    return c.encode(c.speech(), "-m", folder, "-o", c.out / "x.mimi",
                    code=errors.EXIT_MODEL_INVALID, says="no_such_setting")


def _out_of_range_code(c: Ctx) -> Case:
    data = bytearray(c.shared.mimi)
    json_len = struct.unpack_from("<I", data, 8)[0]
    struct.pack_into("<H", data, 20 + json_len + 2 * 8 * 5 + 3 * 2, 4000)  # frame 5, book 3
    return c.decode(c.codes("oor.mimi", bytes(data)), "-o", c.out / "y.wav",
                    code=errors.EXIT_BAD_INPUT, says="invalid code 4000")


def _eight_channels_192k() -> np.ndarray:
    mono = speech_like(1.0, 192000)
    return np.stack([mono * (0.5 + 0.05 * i) for i in range(8)], axis=1)


def _resampled(n: int, rate: int) -> int:
    from personaplex_cli.audio.resample import resampled_length

    return resampled_length(n, rate, SAMPLE_RATE)


def _encode_8ch(c: Ctx) -> Case:
    x = _eight_channels_192k()
    want = _resampled(len(x), 192000)

    def check(work: Path, proc) -> None:
        header, num_frames, codes = _parse_mimi((work / "out" / "x.mimi").read_bytes())
        assert header["num_samples"] == want
        assert num_frames == codes.shape[1] == math.ceil(want / 1920)

    return c.encode(c.wav("c8.wav", x, 192000), "-o", c.out / "x.mimi", code=errors.EXIT_OK,
                    says="", makes=("out/x.mimi",), check=check)


def _reply_8ch(c: Ctx) -> Case:
    x = _eight_channels_192k()
    want = _resampled(len(x), 192000)

    def check(work: Path, proc) -> None:
        info = sf.info(work / "out" / "a.wav")
        assert (info.samplerate, info.channels, info.frames) == (SAMPLE_RATE, 1, want)

    return c.reply(c.wav("c8.wav", x, 192000), c.out / "a.wav", "--seed", "1",
                   code=errors.EXIT_OK, says="", makes=("out/a.wav",), check=check)


def _reply_hostile(c: Ctx, entries, says: str, marker: Path | None = None,
                   command: tuple = ("reply",)) -> Case:
    """A model whose only voices are a voices.tgz holding `entries`; the command asks for
    a voice by name. Its cache (where the archive would be unpacked) is in the folder."""
    model = c.golden_model(voices=False)
    (model / VOICES_ARCHIVE).write_bytes(tgz(entries))
    env = {"XDG_CACHE_HOME": c.work / "cache", "PERSONAPLEX_MODEL": model}
    after = (lambda: _assert_absent(marker)) if marker else None
    if command == ("reply",):
        return c.reply(c.speech(), c.out / "a.wav", "--voice", "NATF2", env=env,
                       code=errors.EXIT_MODEL_INVALID, says=says, after=after)
    return c.voices(*command, env=env, code=errors.EXIT_MODEL_INVALID, says=says, after=after)


def _assert_absent(path: Path) -> None:
    assert not os.path.lexists(path), f"{path} was written"


def _absolute_member(c: Ctx) -> Case:
    target = Path(f"/tmp/personaplex-evil-{uuid.uuid4().hex}.pt")
    return _reply_hostile(c, [("voices", None), ("voices/NATF2.pt", _voice_pt()),
                              (str(target), b"evil")], "has an absolute path", target)


def _reply_voices_tgz_fresh_cache(c: Ctx) -> Case:
    model = c.golden_model(voices=False)
    (model / VOICES_ARCHIVE).write_bytes(tgz([("voices", None),
                                               ("voices/NATF2.pt", _voice_pt())]))

    def check(work: Path, proc) -> None:
        assert sf.info(work / "out" / "a.wav").frames == 36000
        assert len(list((work / "cache").rglob("NATF2.pt"))) == 1

    return c.reply(c.speech(), c.out / "a.wav", "--voice", "NATF2", "--seed", "1",
                   env={"XDG_CACHE_HOME": c.work / "cache", "PERSONAPLEX_MODEL": model},
                   code=errors.EXIT_OK, says="", makes=("out/a.wav", "cache"), check=check)


def _pickle_voice(c: Ctx, where: str, legacy: bool = False) -> Case:
    marker = c.work / "pickle-ran"
    bomb = _pickle_bomb(marker, legacy)
    env, voice = {}, "NATF2"
    if where == "file":
        voice = str(c.file("evil.pt", bomb))
    elif where == "packaged":
        model = c.golden_model(voices=False)
        c.file("model/voices/NATF2.pt", bomb)
        env = {"PERSONAPLEX_MODEL": model}
    elif where == "user":
        c.file("my-voices/Robin.pt", bomb)
        voice = "Robin"
    return c.reply(c.speech(), c.out / "a.wav", "--voice", voice, env=env,
                   code=errors.EXIT_BAD_INPUT, says=NOT_A_VOICE,
                   after=lambda: _assert_absent(marker))


def _voices_show_pickle(c: Ctx) -> Case:
    marker = c.work / "pickle-ran"
    return c.voices("show", c.file("evil.pt", _pickle_bomb(marker)),
                    code=errors.EXIT_BAD_INPUT, says=NOT_A_VOICE,
                    after=lambda: _assert_absent(marker))


def _reply_model(c: Ctx, change: Callable[[Path], None], code: int, says: str) -> Case:
    model = c.golden_model()
    change(model)
    return c.reply(c.speech(), c.out / "a.wav", env={"PERSONAPLEX_MODEL": model},
                   code=code, says=says)


def _reply_to_a_terminal(c: Ctx, change: Callable[[Path], None]) -> Case:
    model = c.golden_model()
    change(model)
    return c.reply(c.speech(), "-", tty="stdout", env={"PERSONAPLEX_MODEL": model},
                   code=OUT, says="terminal")


def _garbage(name: str, data: bytes = b"garbage\n" * 16) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        (model / name).unlink()
        (model / name).write_bytes(data)
    return change


def _without(name: str) -> Callable[[Path], None]:
    return lambda model: (model / name).unlink()


def _arch_mismatch(model: Path) -> None:
    arch = json.loads((model / "personaplex-arch.json").read_text())
    arch["lm"]["num_layers"] = 3
    (model / "personaplex-arch.json").write_text(json.dumps(arch))


def _download_corrupt(c: Ctx) -> Case:
    hub = c.shared.hubs["corrupt"]
    hub.add_repo("t/corrupt", _hub_files())
    hub.corrupt.add(MIMI_FILE)
    cache = c.shared.root / "hub-cache-corrupt"  # what was fetched whole is kept by design
    return c.download("-m", "t/corrupt", hub="corrupt", cache=cache, code=errors.EXIT_MODEL_MISSING,
                      says="does not match its sha256",
                      after=_hub_cache_has_no(cache, "voices"))


def _download_broken_transfer(c: Ctx) -> Case:
    hub = c.shared.hubs["cut"]
    hub.add_repo("t/cut", _hub_files())
    hub.cut_after(LM_FILE, 1000, times=100)
    cache = c.shared.root / "hub-cache-cut"  # the partial file is kept to resume, by design
    return c.download("-m", "t/cut", hub="cut", cache=cache, code=errors.EXIT_MODEL_MISSING,
                      says="broke off", after=_hub_cache_has_no(cache, "voices"))


def _download_hostile(c: Ctx) -> Case:
    c.shared.hubs["main"].add_repo("t/hostile", _hub_files(voices=tgz(
        [("voices", None), ("voices/NATF0.pt", b"fine"), ("voices/../../outside/evil.pt",
                                                          b"evil")])))
    cache = c.shared.root / "hub-cache-hostile"  # the fetched files are kept, by design
    return c.download("-m", "t/hostile", cache=cache, code=errors.EXIT_MODEL_INVALID,
                      says="voices.tgz is refused", after=_hub_cache_has_no(
                          cache, "voices", "outside", "evil.pt"))


def _download_disk_full(c: Ctx) -> Case | str:
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    disk = c.shared.root / "small-disk"
    disk.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs",
                           str(disk)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return f"cannot mount a tmpfs here: {proc.stderr.strip()}"
    c.shared.cleanups.append(lambda: subprocess.run(["umount", "-l", str(disk)],
                                                    capture_output=True, check=False))
    c.shared.hubs["main"].add_repo("t/big", _hub_files(lm_size=2 << 20))
    return c.download("-m", "t/big", cache=disk / "cache", code=errors.EXIT_OUTPUT,
                      says="not enough space", after=lambda: _assert_no_files(disk))


def _assert_no_files(folder: Path) -> None:
    files = [str(p) for p in folder.rglob("*") if p.is_file()]
    assert not files, files


def _talk_list_devices(c: Ctx) -> Case | str:
    import ctypes.util

    if ctypes.util.find_library("portaudio") is None:
        return "PortAudio is not installed (talk --list-devices then exits 4)"

    def check(work: Path, proc) -> None:
        assert proc.stdout.strip(), "nothing listed, not even 'no audio devices found'"

    # No model anywhere: listing the devices needs none.
    return c.talk("--list-devices", env={"PERSONAPLEX_MODEL": c.work / "no-model"},
                  code=errors.EXIT_OK, says="", check=check)


BAD, OUT, MISSING, INVALID = (errors.EXIT_BAD_INPUT, errors.EXIT_OUTPUT,
                              errors.EXIT_MODEL_MISSING, errors.EXIT_MODEL_INVALID)

CASES: dict[str, Callable[[Ctx], Case | str]] = {
    # -- encode: audio in ------------------------------------------------------------------
    "encode-empty-file": lambda c: c.encode(c.file("empty.wav", b""), "-o", c.out / "x.mimi",
                                            code=BAD, says="empty file"),
    "encode-truncated-wav-header": lambda c: c.encode(
        c.file("cut.wav", c.shared.speech_wav.read_bytes()[:30]), "-o", c.out / "x.mimi",
        code=BAD, says="cut.wav"),
    "encode-corrupt-wav": lambda c: c.encode(c.file("noise.wav", _riff_then_noise()),
                                             "-o", c.out / "x.mimi", code=BAD, says="noise.wav"),
    "encode-text-file": lambda c: c.encode(c.file("notes.txt", b"not audio\n" * 20), "-o",
                                           c.out / "x.mimi", code=BAD, says="not an audio file"),
    "encode-nan": lambda c: c.encode(c.file("nan.wav", _nan_wav(0.5)), "-o", c.out / "x.mimi",
                                     code=BAD, says="NaN"),
    "encode-missing-input": lambda c: c.encode(c.work / "absent.wav", "-o", c.out / "x.mimi",
                                               code=BAD, says="no such file"),
    "encode-input-is-a-directory": lambda c: c.encode(c.out, "-o", c.work / "x.mimi",
                                                      code=BAD, says="is a directory"),
    "encode-empty-stdin": lambda c: c.encode("-", "-o", c.out / "x.mimi", stdin=b"",
                                             code=BAD, says="empty input"),
    "encode-corrupt-wav-stdin": lambda c: c.encode(
        "-", "-o", c.out / "x.mimi", stdin=_riff_then_noise(), code=BAD, says="stdin"),
    "encode-stdin-is-a-terminal": lambda c: c.encode("-", "-o", c.out / "x.mimi", tty="stdin",
                                                     code=BAD, says="stdin is a terminal"),
    "encode-stdout-is-a-terminal": lambda c: c.encode(c.speech(), "-o", "-", tty="stdout",
                                                      code=OUT, says="terminal"),
    # One hour of input, kept fast: a real hour of audio (~170 MB) would take minutes, so
    # the header declares the hour and the data ends after 1.5 s: a truncated file the
    # reader must refuse at once without a partial file. On a pipe such a header is an
    # estimate (sox writes one): the 1.5 s are the input, with one warning.
    "encode-one-hour-header-stdin": lambda c: c.encode(
        "-", "-o", c.out / "x.mimi", stdin=_one_hour_wav(c.shared.speech_wav.read_bytes()),
        code=errors.EXIT_OK, says="", makes=("out/x.mimi",),
        check=_read_to_its_end("x.mimi")),
    "encode-one-hour-header-file": lambda c: c.encode(
        c.file("hour.wav", _one_hour_wav(c.shared.speech_wav.read_bytes())), "-o",
        c.out / "x.mimi", code=BAD, says="truncated WAV"),
    "encode-8-channels-192k": _encode_8ch,
    # -- encode: the model --------------------------------------------------------------------
    "encode-model-dir-missing": lambda c: c.encode(c.speech(), "-m", c.work / "no-such-model",
                                                   "-o", c.out / "x.mimi", code=MISSING,
                                                   says="does not exist"),
    "encode-model-is-a-file": lambda c: c.encode(c.speech(), "-m", c.speech("model.bin"),
                                                 "-o", c.out / "x.mimi", code=MISSING,
                                                 says="expects a model directory"),
    "encode-model-without-mimi": lambda c: c.encode(
        c.speech(), "-m", c.tiny_copy(with_mimi=False), "-o", c.out / "x.mimi",
        code=MISSING, says="Mimi codec checkpoint"),
    "encode-model-with-two-mimis": lambda c: c.encode(
        c.speech(), "-m", _two_mimis(c.tiny_copy(with_mimi=False), c.shared.tiny), "-o",
        c.out / "x.mimi", code=MISSING,
        says="has several files"),
    "encode-model-repo-not-cached": lambda c: c.encode(
        c.speech(), "-o", c.out / "x.mimi", env={"PERSONAPLEX_MODEL": None}, code=MISSING,
        says="personaplex download"),
    "encode-model-wrong-shape": _wrong_shape_model,
    "encode-model-not-safetensors": lambda c: c.encode(
        c.speech(), "-m", _garbage_mimi(c.tiny_copy(with_mimi=False)), "-o", c.out / "x.mimi",
        code=INVALID, says="cannot read checkpoint"),
    "encode-model-arch-unknown-key": _unknown_arch_key,
    # -- encode: the output --------------------------------------------------------------------
    "encode-output-dir-missing": lambda c: c.encode(
        c.speech(), "-o", c.out / "no" / "such" / "dir" / "x.mimi", code=OUT,
        says="No such file or directory"),
    "encode-output-new-dir-with-slash": lambda c: c.encode(
        c.speech(), "-o", f"{c.out}/new/", code=OUT, says="no such directory"),
    "encode-output-is-a-directory": lambda c: c.encode(c.speech(), "-o", c.out, code=OUT,
                                                       says="is a directory"),
    "encode-output-dir-unwritable": _unwritable,
    "encode-output-exists": lambda c: c.encode(
        c.speech(), "-o", c.file("out/x.mimi", b"keep me\n"), code=OUT, says="exists"),
    "encode-output-is-the-input": lambda c: c.encode(
        c.speech("x.wav"), "-o", f"{c.work}/./x.wav", "--format", "mimi", "--force", code=OUT,
        says="is also the input"),
    "encode-device-cuda-unavailable": lambda c: _cuda_reason() or c.encode(
        c.speech(), "--device", "cuda", "-o", c.out / "x.mimi", code=errors.EXIT_DEVICE,
        says="CUDA is not available"),
    # -- encode: usage -------------------------------------------------------------------------
    "encode-usage-unknown-option": lambda c: c.usage("encode", c.speech(), "--bogus",
                                                     says="No such option: --bogus"),
    "encode-usage-invalid-format": lambda c: c.usage("encode", c.speech(), "--format", "wav",
                                                     says="'auto', 'mimi', 'npy'"),
    "encode-usage-codebooks-0": lambda c: c.usage("encode", c.speech(), "--codebooks", "0",
                                                  says="--codebooks"),
    "encode-usage-codebooks-33": lambda c: c.usage("encode", c.speech(), "-k", "33",
                                                   says="--codebooks"),
    "encode-usage-device-bogus": lambda c: c.usage("encode", c.speech(), "--device", "bogus",
                                                   says="expected auto, cpu, cuda or cuda:N"),
    "encode-usage-format-against-mimi-suffix": lambda c: c.usage(
        "encode", c.speech(), "-o", c.out / "c.mimi", "--format", "npy",
        says="c.mimi names mimi but npy was asked for"),
    "encode-usage-format-against-npy-suffix": lambda c: c.usage(
        "encode", c.speech(), "-o", c.out / "c.npy", "--format", "mimi",
        says="c.npy names npy but mimi was asked for"),
    "encode-usage-missing-input": lambda c: c.usage("encode", "-o", c.out / "x.mimi",
                                                    says="Missing argument 'IN'"),
    "encode-usage-extra-argument": lambda c: c.usage("encode", c.speech(), "--verbose", "2",
                                                     says="unexpected extra argument"),

    # -- decode: codes in ------------------------------------------------------------------------
    "decode-mimi-bad-magic": lambda c: c.decode(
        c.codes("bad.mimi", b"MIMX" + c.shared.mimi[4:]), "-o", c.out / "y.wav", code=BAD,
        says="not a .mimi or .npy code file"),
    "decode-mimi-unknown-version": lambda c: c.decode(
        c.codes("v9.mimi", c.shared.mimi[:4] + b"\x09" + c.shared.mimi[5:]), "-o",
        c.out / "y.wav", code=BAD, says="version"),
    "decode-mimi-truncated-frame": lambda c: c.decode(
        c.codes("cut.mimi", c.shared.mimi[:-3]), "-o", c.out / "y.wav", code=BAD,
        says="cut.mimi"),
    "decode-mimi-zero-codebooks": lambda c: c.decode(
        c.codes("k0.mimi", mimi_with_header(c.shared.mimi, num_codebooks=0)), "-o",
        c.out / "y.wav", code=BAD, says="num_codebooks"),
    "decode-mimi-40-codebooks": lambda c: c.decode(
        c.codes("k40.mimi", mimi_with_header(c.shared.mimi, num_codebooks=40)), "-o",
        c.out / "y.wav", code=BAD, says="num_codebooks"),
    "decode-mimi-code-out-of-range": _out_of_range_code,
    "decode-mimi-unknown-window": lambda c: c.decode(
        c.codes("w.mimi", mimi_with_header(c.shared.mimi, window="bogus")), "-o",
        c.out / "y.wav", code=BAD, says="window must be one of"),
    "decode-mimi-other-weights": lambda c: c.decode(
        c.codes("w.mimi", mimi_with_header(c.shared.mimi, weights_sha256="0" * 64)), "-o",
        c.out / "y.wav", code=BAD, says="--ignore-weights"),
    "decode-mimi-empty-stdin": lambda c: c.decode("-", "-o", c.out / "y.wav", stdin=b"",
                                                  code=BAD, says="empty input"),
    "decode-npy-3-dims": lambda c: c.decode(
        c.file("c.npy", _npy_bytes(np.zeros((2, 8, 5), np.uint16))), "-o", c.out / "y.wav",
        code=BAD, says="2-D"),
    "decode-text-file": lambda c: c.decode(c.file("notes.mimi", b"not codes\n" * 8), "-o",
                                           c.out / "y.wav", code=BAD, says="not a .mimi"),
    "decode-missing-input": lambda c: c.decode(c.work / "absent.mimi", "-o", c.out / "y.wav",
                                               code=BAD, says="no such file"),
    # One hour of codes, kept fast (see encode-one-hour-header-stdin): the preamble and the
    # header declare 45000 frames, the file holds 19.
    "decode-one-hour-header": lambda c: c.decode(
        c.codes("hour.mimi", _one_hour_mimi(c.shared.mimi)), "-o", c.out / "y.wav", code=BAD,
        says="header declares 45000 frames"),
    "decode-one-hour-header-stdin": lambda c: c.decode(
        "-", "-o", c.out / "y.wav", stdin=_one_hour_mimi(c.shared.mimi), code=BAD,
        says="header declares 45000 frames"),
    # -- decode: the output ----------------------------------------------------------------------
    "decode-output-is-the-input": lambda c: c.decode(
        c.codes("y.mimi"), "-o", c.work / "y.mimi", "--force", "--raw", code=OUT,
        says="is also the input"),
    "decode-output-dir-missing": lambda c: c.decode(c.codes(), "-o", c.out / "no" / "y.wav",
                                                    code=OUT, says="No such file or directory"),
    "decode-output-new-dir-with-slash": lambda c: c.decode(c.codes(), "-o", f"{c.out}/new/",
                                                           code=OUT, says="no such directory"),
    "decode-stdout-is-a-terminal": lambda c: c.decode(c.codes(), "-o", "-", tty="stdout",
                                                      code=OUT, says="terminal"),
    # -- decode: usage ---------------------------------------------------------------------------
    "decode-usage-raw-with-wav-output": lambda c: c.usage(
        "decode", c.codes(), "--raw", "-o", c.out / "x.wav", says="names wav but raw"),
    "decode-usage-raw-with-format": lambda c: c.usage(
        "decode", c.codes(), "--raw", "--format", "flac", "-o", "-", says="--raw contradicts"),
    "decode-usage-format-against-suffix": lambda c: c.usage(
        "decode", c.codes(), "--format", "wav", "-o", c.out / "t.flac", says="names flac"),
    "decode-usage-output-aiff": lambda c: c.usage(
        "decode", c.codes(), "-o", c.out / "y.aiff",
        says="does not write .aiff files; name it .wav, .flac, .ogg, .opus or .raw"),
    "decode-usage-f32-in-flac": lambda c: c.usage(
        "decode", c.codes(), "--sample-format", "f32", "-o", c.out / "t.flac",
        says="flac output does not take --sample-format f32"),
    "decode-usage-invalid-format": lambda c: c.usage(
        "decode", c.codes(), "--format", "mp4", says="'wav', 'flac', 'ogg', 'opus', 'raw'"),
    "decode-usage-rate-too-low": lambda c: c.usage("decode", c.codes(), "--rate", "10",
                                                   says="--rate"),
    "decode-usage-rate-too-high": lambda c: c.usage("decode", c.codes(), "--rate", "500000",
                                                    says="--rate"),
    "decode-usage-rate-opus-cannot-store": lambda c: c.usage(
        "decode", c.codes(), "-o", c.out / "y.opus", "--rate", "44100",
        says="Opus cannot store 44100 Hz"),
    # libvorbis crashed the process (SIGSEGV, a .part left behind) above 200 kHz.
    "decode-usage-rate-vorbis-cannot-store": lambda c: c.usage(
        "decode", c.codes(), "-o", c.out / "y.ogg", "--rate", "384000",
        says="Ogg Vorbis cannot store 384000 Hz"),
    "decode-usage-missing-input": lambda c: c.usage("decode", "-o", c.out / "y.wav",
                                                    says="Missing argument 'IN'"),
    "decode-usage-unknown-option": lambda c: c.usage("decode", c.codes(), "--bogus",
                                                     says="No such option"),

    # -- reply: the recordings ---------------------------------------------------------------------
    "reply-missing-input": lambda c: c.reply(c.work / "absent.wav", c.out / "a.wav", code=BAD,
                                             says="no such file"),
    "reply-input-is-a-directory": lambda c: c.reply(c.out, c.work / "a.wav", code=BAD,
                                                    says="is a directory"),
    "reply-corrupt-input": lambda c: c.reply(c.file("noise.wav", _riff_then_noise()),
                                             c.out / "a.wav", code=BAD, says="noise.wav"),
    "reply-one-bad-input-among-several": lambda c: c.reply(
        c.speech("a.wav"), c.file("b.wav", b"not audio\n" * 20), c.out, code=BAD,
        says="b.wav"),
    "reply-nan": lambda c: c.reply(c.file("nan.wav", _nan_wav()), c.out / "a.wav", code=BAD,
                                   says="NaN"),
    "reply-no-samples": lambda c: c.reply(c.wav("empty.wav", np.zeros(0, np.float32)),
                                          c.out / "a.wav", code=BAD, says="no audio samples"),
    "reply-one-hour-header-file": lambda c: c.reply(
        c.file("hour.wav", _one_hour_wav(c.shared.speech_wav.read_bytes())), c.out / "a.wav",
        code=BAD, says="of the 3600.00 s its header declares"),
    "reply-one-hour-header-stdin": lambda c: c.reply(
        "-", c.out / "a.wav", "--seed", "1",
        stdin=_one_hour_wav(c.shared.speech_wav.read_bytes()), code=errors.EXIT_OK, says="",
        makes=("out/a.wav",), check=_read_to_its_end("a.wav")),
    "reply-8-channels-192k": _reply_8ch,
    # -- reply: the voice --------------------------------------------------------------------------
    "reply-unknown-voice": lambda c: c.reply(c.speech(), c.out / "a.wav", "--voice", "NOBODY",
                                             code=BAD, says="unknown voice 'NOBODY'"),
    "reply-voice-file-missing": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.work / "absent.pt", code=BAD,
        says="does not exist"),
    # A packaged voice that is not here is missing, as the model's other files (issue 13.11).
    "reply-no-packaged-voices": lambda c: c.reply(
        c.speech(), c.out / "a.wav", env={"PERSONAPLEX_MODEL": c.golden_model(voices=False)},
        code=MISSING, says="voice NATF2 is one of the packaged voices, but it is not on this "
        "machine: copy voices/ or voices.tgz"),
    "reply-packaged-voice-not-here": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", "VARM4", code=MISSING,
        says="there is no VARM4.pt in"),
    "reply-unknown-voice-no-packaged-voices": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", "NOBODY",
        env={"PERSONAPLEX_MODEL": c.golden_model(voices=False)}, code=BAD,
        says="unknown voice 'NOBODY'; the model has no packaged voices (copy voices/"),
    "reply-pickle-voice-file": lambda c: _pickle_voice(c, "file"),
    "reply-pickle-voice-legacy-file": lambda c: _pickle_voice(c, "file", legacy=True),
    "reply-pickle-voice-packaged": lambda c: _pickle_voice(c, "packaged"),
    "reply-pickle-voice-user": lambda c: _pickle_voice(c, "user"),
    "reply-voice-not-torch": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("x.pt", b"not a torch file"),
        code=BAD, says=NOT_A_VOICE),
    "reply-voice-wrong-keys": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("keys.pt", _voice_bytes(64, extra=True)),
        code=BAD, says=NOT_A_VOICE),
    "reply-voice-for-another-model": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("other.pt", _voice_bytes(32)),
        code=BAD, says="was made for another model"),
    # A .pt voice is checked whole against the model before it loads (issue 20.3).
    "reply-voice-token-past-the-card": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("big.pt", _bad_voice(token=2049)),
        code=BAD, says="big.pt is not a valid voice: its token cache holds audio tokens "
        "outside 0..2048"),
    "reply-voice-negative-token": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("neg.pt", _bad_voice(token=-1)),
        code=BAD, says="neg.pt is not a valid voice"),
    "reply-voice-nan-embedding": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("nan.pt", _bad_voice(nan=True)),
        code=BAD, says="nan.pt is not a valid voice: its embeddings hold NaN"),
    "reply-voice-short-ring": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("ring.pt", _bad_voice(columns=3)),
        code=BAD, says="its token cache has 3 columns"),
    "reply-voice-bool-cache": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("bool.pt", _bad_voice(boolean=True)),
        code=BAD, says="'cache' must be an integer tensor"),
    "voices-show-token-past-the-card": lambda c: c.voices(
        "show", c.file("big.pt", _bad_voice(token=5000)), code=BAD,
        says="big.pt is not a valid voice"),
    # -- no file a run reads is ever one of its outputs, --force or not (issue 20.1) ----------
    "reply-output-is-the-voice-recording": lambda c: c.reply(
        c.speech(), c.file("vp.wav", _advised_recording()), "--voice", c.work / "vp.wav",
        "--force", code=OUT, says="vp.wav is also read by this run"),
    "reply-output-links-to-the-voice-recording": lambda c: _output_links_to_voice(c),
    "reply-codes-out-is-a-hard-link-to-the-voice": lambda c: _codes_out_hard_link(c),
    "reply-text-out-is-the-prompt-file": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--prompt-file", c.file("p.txt", b"Be brief.\n"),
        "--text-out", c.work / "p.txt", "--force", prompt=False, code=OUT,
        says="p.txt is also read by this run"),
    "reply-manifest-row-writes-what-another-reads": lambda c: _manifest_row_writes_an_input(c),
    "reply-manifest-row-writes-the-manifest": lambda c: _manifest_writes_itself(c),
    "encode-output-is-a-model-file": lambda c: _encode_over_the_checkpoint(c),
    "reply-voice-recording-corrupt": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("voice.wav", _riff_then_noise()),
        code=BAD, says="voice.wav"),
    "reply-voice-recording-too-short": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.wav("voice.wav", speech_like(0.2)),
        code=BAD, says="too short"),
    "reply-voice-recording-silent": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.wav("voice.wav", np.zeros(48000)),
        code=BAD, says="silent"),
    "reply-voice-recording-nan": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.file("voice.wav", _nan_wav()), code=BAD,
        says="NaN"),
    # -- reply: voices.tgz -------------------------------------------------------------------------
    "reply-voices-tgz-dotdot": lambda c: _reply_hostile(
        c, [("voices", None), ("voices/NATF2.pt", _voice_pt()),
            ("voices/../../evil.pt", b"evil")], "contains '..'"),
    "reply-voices-tgz-absolute": _absolute_member,
    "reply-voices-tgz-symlink": lambda c: _reply_hostile(
        c, [("voices", None), _symlink("voices/NATF2.pt", "/etc/passwd")],
        "is a symbolic link"),
    "reply-voices-tgz-symlink-then-write-through": lambda c: _reply_hostile(
        c, [("voices", None), _symlink("voices/out", "../../escaped"),
            ("voices/out/NATF2.pt", _voice_pt())], "is a symbolic link"),
    "reply-voices-tgz-damaged": lambda c: _damagedtgz(c),
    "reply-voices-tgz-fresh-cache": _reply_voices_tgz_fresh_cache,
    # -- reply: the role prompt ------------------------------------------------------------------
    "reply-empty-prompt": lambda c: c.reply(c.speech(), c.out / "a.wav", "--prompt", "   ",
                                            prompt=False, code=BAD, says="role prompt is empty"),
    "reply-prompt-longer-than-context": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--prompt", "word " * 400, prompt=False, code=BAD,
        says="more than the model's context"),
    "reply-prompt-file-longer-than-context": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--prompt-file", c.file("role.txt", b"word " * 400),
        prompt=False, code=BAD, says="more than the model's context"),
    "reply-prompt-file-missing": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--prompt-file", c.work / "absent.txt", prompt=False,
        code=BAD, says="cannot read the prompt file"),
    "reply-prompt-file-not-utf8": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--prompt-file", c.file("role.txt", "caf\xe9".encode(
            "latin-1")), prompt=False, code=BAD, says="cannot read the prompt file"),
    # -- reply: the outputs ----------------------------------------------------------------------
    "reply-output-exists": lambda c: c.reply(c.speech(), c.file("out/a.wav", b"keep"),
                                             code=OUT, says="exists"),
    "reply-text-output-exists": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--text-out", c.file("out/a.txt", b"keep"), code=OUT,
        says="a.txt exists"),
    "reply-output-is-the-input": lambda c: c.reply(c.speech("q.wav"), c.work / "q.wav", "-f",
                                                   code=OUT, says="is also the input"),
    "reply-output-dir-missing": lambda c: c.reply(c.speech(), c.out / "no" / "a.wav",
                                                  code=OUT, says="no such directory"),
    "reply-output-new-dir-with-slash": lambda c: c.reply(c.speech(), f"{c.out}/new/",
                                                         code=OUT, says="no such directory"),
    "reply-several-output-dir-missing": lambda c: c.reply(
        c.speech("a.wav"), c.speech("b.wav"), c.out / "no", code=OUT,
        says="no does not exist; with several inputs OUT must be an existing directory"),
    "reply-several-output-new-dir-with-slash": lambda c: c.reply(
        c.speech("a.wav"), c.speech("b.wav"), f"{c.out}/new/", code=OUT,
        says="new/ does not exist; with several inputs"),
    "reply-several-output-is-a-file": lambda c: c.reply(
        c.speech("a.wav"), c.speech("b.wav"), c.file("out/a-file", b"keep"), code=OUT,
        says="a-file is not a directory; with several inputs"),
    "reply-stdin-into-a-directory": lambda c: c.reply(
        "-", c.out, stdin=c.shared.speech_wav.read_bytes(), code=OUT,
        says="needs an output file name"),
    "reply-two-outputs-same-name": lambda c: c.reply(
        c.speech("a/q.wav"), c.speech("b/q.wav"), c.out, code=OUT, says="the same name"),
    "reply-two-outputs-on-stdout": lambda c: c.reply(c.speech(), "-", "--text-out", "-",
                                                     code=OUT, says="only one output"),
    "reply-stdout-is-a-terminal": lambda c: c.reply(c.speech(), "-", tty="stdout", code=OUT,
                                                    says="terminal"),
    # Refused before the model loads (it would be after a 17 GB load): a checkpoint that
    # cannot be read is never reached.
    "reply-stdout-is-a-terminal-before-the-model": lambda c: _reply_to_a_terminal(
        c, _garbage("model.safetensors")),
    # -- reply: the model and the device ---------------------------------------------------------
    "reply-model-missing": lambda c: c.reply(
        c.speech(), c.out / "a.wav", env={"PERSONAPLEX_MODEL": c.work / "no-model"},
        code=MISSING, says="does not exist"),
    "reply-model-without-lm": lambda c: _reply_model(c, _without("model.safetensors"), MISSING,
                                                     "the language model checkpoint"),
    "reply-model-without-tokenizer": lambda c: _reply_model(
        c, _without("tokenizer_spm_tiny_512.model"), MISSING, "the text tokenizer"),
    "reply-model-lm-corrupt": lambda c: _reply_model(c, _garbage("model.safetensors"),
                                                     INVALID, "cannot read checkpoint"),
    "reply-model-tokenizer-corrupt": lambda c: _reply_model(
        c, _garbage("tokenizer_spm_tiny_512.model"), INVALID, "cannot read the text tokenizer"),
    "reply-model-arch-mismatch": lambda c: _reply_model(c, _arch_mismatch, INVALID,
                                                        "does not match the architecture"),
    "reply-model-arch-not-json": lambda c: _reply_model(
        c, _garbage("personaplex-arch.json", b"{not json"), INVALID, "personaplex-arch.json"),
    "reply-device-cuda-unavailable": lambda c: _cuda_reason() or c.reply(
        c.speech(), c.out / "a.wav", "--device", "cuda", code=errors.EXIT_DEVICE,
        says="CUDA is not available"),
    # -- reply: usage ----------------------------------------------------------------------------
    "reply-usage-missing-arguments": lambda c: c.usage("reply", "--voice", "x",
                                                       says="Missing argument 'IN... OUT'"),
    "reply-usage-no-output": lambda c: c.usage("reply", c.speech(), says="name the output"),
    "reply-usage-prompt-and-prompt-file": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--prompt", "X", "--prompt-file",
        c.file("role.txt", b"Y"), says="give --prompt or --prompt-file, not both"),
    "reply-usage-stdin-twice": lambda c: c.usage(
        "reply", "-", c.out / "a.wav", "--prompt-file", "-", tty="open-stdin",
        says="stdin cannot be both"),
    "reply-usage-stdin-among-several": lambda c: c.usage(
        "reply", "-", c.speech(), c.out, stdin=b"", says="stdin (-) can be the only input"),
    "reply-usage-text-file-for-several": lambda c: c.usage(
        "reply", c.speech("a.wav"), c.speech("b.wav"), c.out, "--text-out", c.out / "t.txt",
        says="with several inputs, give a format"),
    "reply-usage-output-mp3": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.mp3",
        says="does not write .mp3 files; name it .wav, .flac, .ogg, .opus or .raw"),
    "reply-usage-output-m4a": lambda c: c.usage("reply", c.speech(), "-o", c.out / "a.m4a",
                                                says="does not write .m4a files"),
    "reply-usage-f32-in-ogg": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.ogg", "--sample-format", "f32",
        says="ogg output does not take --sample-format f32"),
    "reply-usage-rate-opus-cannot-store": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.opus", "--rate", "44100",
        says="Opus cannot store 44100 Hz"),
    "reply-usage-invalid-dtype": lambda c: c.usage("reply", c.speech(), c.out / "a.wav",
                                                   "--dtype", "fp8",
                                                   says="'bf16', 'fp16', 'fp32'"),
    "reply-usage-batch-size-0": lambda c: c.usage("reply", c.speech(), c.out / "a.wav", "-b",
                                                  "0", says="--batch-size"),
    "reply-usage-batch-size-257": lambda c: c.usage("reply", c.speech(), c.out / "a.wav",
                                                    "-b", "257", says="--batch-size"),
    "reply-usage-temperature-negative": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--temperature", "-1", says="--temperature"),
    "reply-usage-temperature-inf": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--temperature", "inf",
        says="'--temperature': must be a finite number, not inf"),
    "reply-usage-audio-temperature-inf": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--audio-temperature", "inf",
        says="'--audio-temperature': must be a finite number, not inf"),
    "reply-usage-temperature-nan": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--temperature", "nan",
        says="'--temperature': nan is not a number"),
    "reply-usage-audio-temperature-nan": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--audio-temperature", "nan",
        says="'--audio-temperature': nan is not a number"),
    "reply-usage-tail-silence-nan": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--tail-silence", "nan",
        says="'--tail-silence': nan is not a number"),
    "reply-usage-top-k-negative": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--top-k", "-1", says="--top-k"),
    "reply-usage-tail-silence-too-long": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--tail-silence", "601", says="--tail-silence"),
    "reply-usage-seed-negative": lambda c: c.usage("reply", c.speech(), c.out / "a.wav",
                                                   "--seed", "-1", says="--seed"),
    # -- smaller ones (issue 20.6) ---------------------------------------------------------
    "reply-usage-voice-from-stdin": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--voice", "-", "-p", SHORT_PROMPT,
        says="a voice is read from a file, never from stdin"),
    "reply-voice-is-a-directory": lambda c: c.reply(
        c.speech(), c.out / "a.wav", "--voice", c.out, code=BAD,
        says="out is a directory: name a .pt or .wav file in it"),
    "encode-usage-output-wav": lambda c: c.usage(
        "encode", c.speech(), "-o", c.out / "x.wav",
        says="Invalid value for '--output': cannot write codes to"),
    "reply-usage-codes-out-pt": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--codes-out", c.out / "x.pt", "-p", SHORT_PROMPT,
        says="Invalid value for '--codes-out': cannot write codes to"),
    "serve-usage-host-invalid": lambda c: c.usage("serve", "--host", "999.1.1.1",
                                                  says="999.1.1.1 is not a valid IP address"),
    "encode-usage-device-flag-not-its-variable": lambda c: c.usage(
        "encode", c.speech(), "--device", "bogus",
        says="Invalid value for '--device': expected auto"),
    "encode-usage-device-variable-named": lambda c: c.usage(
        "encode", c.speech(), env={"PERSONAPLEX_DEVICE": "bogus"},
        says="Invalid value for '--device' (env var: 'PERSONAPLEX_DEVICE'): expected auto"),
    "reply-usage-seed-too-large": lambda c: c.usage(
        "reply", c.speech(), c.out / "a.wav", "--seed", "99999999999999999999999",
        says="Invalid value for '--seed'"),
    "talk-usage-seed-too-large": lambda c: c.usage(
        "talk", "--input", c.speech(), "--output", c.out / "a.wav", "--seed", str(2 ** 64),
        says="Invalid value for '--seed'"),
    "reply-usage-device-bogus": lambda c: c.usage("reply", c.speech(), c.out / "a.wav",
                                                  "--device", "gpu", says="--device"),
    "reply-usage-unknown-option": lambda c: c.usage("reply", c.speech(), c.out / "a.wav",
                                                    "--bogus", says="No such option"),

    # -- voices list / show ------------------------------------------------------------------------
    "voices-list-voices-tgz-dotdot": lambda c: _reply_hostile(
        c, [("voices", None), ("voices/../../evil.pt", b"evil")], "contains '..'",
        command=("list",)),
    "voices-list-usage-unknown-option": lambda c: c.usage("voices", "list", "--bogus",
                                                          says="No such option"),
    "voices-show-unknown": lambda c: c.voices("show", "NOBODY", code=BAD,
                                              says="unknown voice 'NOBODY'"),
    "voices-show-no-voice": lambda c: c.voices("show", "", code=BAD, says="means no voice"),
    "voices-show-packaged-not-here": lambda c: c.voices(
        "show", "NATM1", code=MISSING, says="NATM1 is one of the packaged voices, but it is "
        "not on this machine"),
    "voices-show-packaged-model-not-downloaded": lambda c: c.voices(
        "show", "NATM1", env={"PERSONAPLEX_MODEL": "nvidia/personaplex-7b-v1"}, code=MISSING,
        says="is not downloaded: run `personaplex download`"),
    "voices-show-file-missing": lambda c: c.voices("show", c.work / "absent.pt", code=BAD,
                                                   says="does not exist"),
    "voices-show-pickle": _voices_show_pickle,
    "voices-show-not-a-recording": lambda c: c.voices(
        "show", c.file("voice.wav", b"not audio\n" * 8), code=BAD,
        says="is not a readable recording"),
    "voices-show-voices-tgz-symlink": lambda c: _reply_hostile(
        c, [("voices", None), _symlink("voices/NATF2.pt", "/etc/passwd")],
        "is a symbolic link", command=("show", "NATF2")),
    "voices-show-usage-missing-name": lambda c: c.usage("voices", "show",
                                                        says="Missing argument 'NAME'"),
    # -- voices create -----------------------------------------------------------------------------
    "voices-create-too-short": lambda c: c.voices(
        "create", c.wav("r.wav", 0.3 * np.sin(np.arange(12000) / 10)), "v1", code=BAD,
        says="at least"),
    "voices-create-silent": lambda c: c.voices("create", c.wav("r.wav", np.zeros(72000)), "v1",
                                               code=BAD, says="silent"),
    "voices-create-unreadable": lambda c: c.voices(
        "create", c.file("r.wav", b"not audio at all\n" * 50), "v1", code=BAD, says="r.wav"),
    "voices-create-nan": lambda c: c.voices("create", c.file("r.wav", _nan_wav()), "v1",
                                            code=BAD, says="NaN"),
    "voices-create-one-hour-header": lambda c: c.voices(
        "create", c.file("r.wav", _one_hour_wav(c.shared.speech_wav.read_bytes())), "v1",
        code=BAD, says="truncated WAV"),
    "voices-create-missing-recording": lambda c: c.voices(
        "create", c.work / "absent.wav", "v1", code=BAD, says="no such file"),
    "voices-create-bad-name": lambda c: c.voices("create", c.speech(), "../escape", code=BAD,
                                                 says="cannot be a voice name"),
    "voices-create-name-with-suffix": lambda c: c.voices("create", c.speech(), "v1.pt",
                                                         code=BAD, says="without a suffix"),
    "voices-create-packaged-name": lambda c: c.voices(
        "create", c.speech(), "VARF1", env={"PERSONAPLEX_VOICES_DIR": c.work / "my-voices"},
        code=OUT, says="VARF1 is the name of a packaged voice"),
    "voices-create-exists": lambda c: c.voices(
        "create", c.file("r.wav", _advised_recording()), "v1",
        env={"PERSONAPLEX_VOICES_DIR": c.file("my-voices/v1.pt", b"keep").parent}, code=OUT,
        says="use --force"),
    "voices-create-output-dir-missing": lambda c: c.voices(
        "create", c.file("r.wav", _advised_recording()), "v1",
        env={"PERSONAPLEX_VOICES_DIR": c.file("a-file", b"x") / "voices"}, code=OUT,
        says="cannot create the voices folder"),
    "voices-create-model-missing": lambda c: c.voices(
        "create", c.file("r.wav", _advised_recording()), "v1",
        env={"PERSONAPLEX_MODEL": c.work / "no-model"}, code=MISSING, says="does not exist"),
    "voices-create-device-cuda-unavailable": lambda c: _cuda_reason() or c.voices(
        "create", c.file("r.wav", _advised_recording()), "v1",
        "--device", "cuda", code=errors.EXIT_DEVICE, says="CUDA is not available"),
    "voices-create-usage-missing-name": lambda c: c.usage("voices", "create", c.speech(),
                                                          says="Missing argument 'NAME'"),
    "voices-create-usage-invalid-dtype": lambda c: c.usage(
        "voices", "create", c.speech(), "v1", "--dtype", "int8", says="'bf16', 'fp16'"),
    "voices-usage-unknown-command": lambda c: c.usage("voices", "bogus",
                                                      says="No such command 'bogus'"),

    # -- download ----------------------------------------------------------------------------------
    "download-local-folder": lambda c: c.download("-m", c.out, hub=None, code=errors.EXIT_USAGE,
                                                  says="is a local folder"),
    "download-bad-repo-id": lambda c: c.download("-m", "bad repo!", hub=None,
                                                 code=errors.EXIT_USAGE,
                                                 says="is not a valid Hugging Face repo id"),
    "download-offline-not-cached": lambda c: c.download(hub=None, code=MISSING,
                                                        says="HF_HUB_OFFLINE is set"),
    "download-hub-unreachable": lambda c: c.download(
        hub=None, env={"HF_HUB_OFFLINE": None,
                       "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"},
        code=MISSING, says="could not reach the Hugging Face hub"),
    "download-gated-no-token": lambda c: _gated(c, None, "no Hugging Face token was sent"),
    "download-gated-token-without-access": lambda c: _gated(c, "hf_not_on_the_list",
                                                            "has no access to it"),
    "download-token-rejected": lambda c: c.download(
        "-m", _plain_repo(c), env={"HF_TOKEN": "hf_expired"}, code=MISSING,
        says="rejected your token"),
    "download-repo-not-found": lambda c: c.download("-m", "nobody/nothing", code=MISSING,
                                                    says="does not exist on the Hugging Face"),
    "download-revision-not-found": lambda c: c.download(
        "-m", _plain_repo(c), "--revision", "v9", code=MISSING,
        says="revision 'v9' does not exist"),
    "download-not-a-personaplex-repo": lambda c: c.download(
        "-m", _repo_without_voices(c), code=MISSING, says="does not look like a PersonaPlex"),
    "download-corrupt-transfer": _download_corrupt,
    "download-transfer-breaks-off": _download_broken_transfer,
    "download-hostile-voices-tgz": _download_hostile,
    "download-disk-full": _download_disk_full,
    "download-usage-unknown-option": lambda c: c.usage("download", "--bogus",
                                                       says="No such option"),

    # -- doctor: its failing checks end in their own codes (tests/test_doctor.py) ------------------
    "doctor-usage-invalid-dtype": lambda c: c.usage("doctor", "--dtype", "fp8",
                                                    says="'bf16', 'fp16', 'fp32'"),
    "doctor-usage-unknown-option": lambda c: c.usage("doctor", "--bogus",
                                                     says="No such option"),

    # -- the app itself ----------------------------------------------------------------------------
    "app-usage-unknown-command": lambda c: c.usage("bogus", says="No such command 'bogus'"),
    "app-usage-unknown-option": lambda c: c.usage("--bogus", says="No such option"),
    "help-usage-extra-argument": lambda c: c.usage("help", "encode",
                                                   says="unexpected extra argument"),

    # -- talk (personaplex_cli/cli/talk.py, still being built: the obvious cases) ------------------
    "talk-input-missing": lambda c: c.talk("--input", c.work / "absent.wav", "--output",
                                           c.out / "a.wav", code=BAD, says="no such file"),
    "talk-record-exists": lambda c: c.talk(
        "--input", c.speech(), "--output", c.out / "a.wav", "--record",
        c.file("out/rec.wav", b"keep"), code=OUT, says="exists; use --force"),
    "talk-record-is-the-voice": lambda c: c.talk(
        "--input", c.speech(), "--output", c.out / "a.wav", "--voice",
        c.file("vp2.wav", _advised_recording()), "--record", c.work / "vp2.wav", "--force",
        code=OUT, says="vp2.wav is also read by this run"),
    "talk-list-devices-needs-nothing": _talk_list_devices,
    "talk-usage-input-from-stdin": lambda c: c.usage("talk", "--input", "-", "--output",
                                                     c.out / "a.wav", says="name a file"),
    "talk-usage-record-to-stdout": lambda c: c.usage("talk", "--record", "-",
                                                     says="stdout carries the inner monologue"),
    "talk-usage-duration-inf": lambda c: c.usage(
        "talk", "--input", c.speech(), "--output", c.out / "a.wav", "--duration", "inf",
        says="'--duration': must be a finite number, not inf"),
    "talk-usage-buffer-nan": lambda c: c.usage(
        "talk", "--input", c.speech(), "--output", c.out / "a.wav", "--buffer", "nan",
        says="'--buffer': nan is not a number"),
    "talk-usage-output-mp3": lambda c: c.usage(
        "talk", "--input", c.speech(), "--output", c.out / "a.mp3",
        says="does not write .mp3 files"),
    "talk-usage-record-flac": lambda c: c.usage(
        "talk", "--input", c.speech(), "--output", c.out / "a.wav", "--record",
        c.out / "r.flac", says="the recording is a stereo WAV; name it .wav"),
    "talk-usage-input-and-input-device": lambda c: c.usage(
        "talk", "--input", c.speech(), "--input-device", "0", "--output", c.out / "a.wav",
        says="--input replaces the microphone"),
}


def _two_mimis(folder: Path, source: Path) -> Path:
    """Two Mimi checkpoints, neither under the published name (which would be preferred)."""
    checkpoint = next(source.glob("tokenizer-*.safetensors"))
    for name in ("tokenizer-a.safetensors", "tokenizer-b.safetensors"):
        shutil.copy(checkpoint, folder / name)
    return folder


def _garbage_mimi(folder: Path) -> Path:
    (folder / MIMI_FILE).write_bytes(b"not a checkpoint\n" * 8)
    return folder


def _bad_voice(token: int | None = None, nan: bool = False, columns: int = 4,
               boolean: bool = False) -> bytes:
    """The golden .pt voice with one thing wrong: a token of its cache, a NaN embedding,
    a token ring of another width, a cache of booleans."""
    import torch

    voice = torch.load(ASSETS / "voice_prompt_fp32.pt", weights_only=True)
    cache, embeddings = voice["cache"].clone(), voice["embeddings"].clone()
    if token is not None:
        cache[0, 3, 1] = token
    if nan:
        embeddings[2, 0, 0, 5] = float("nan")
    if boolean:
        cache = cache > 0
    return _torch_bytes({"embeddings": embeddings, "cache": cache[:, :, :columns]})


def _output_links_to_voice(c: Ctx) -> Case:
    voice = c.file("vp.wav", _advised_recording())
    (c.out / "a.wav").symlink_to(voice)
    return c.reply(c.speech(), c.out / "a.wav", "--voice", voice, "--force", code=OUT,
                   says="a.wav is also read by this run (as")


def _codes_out_hard_link(c: Ctx) -> Case:
    voice = c.file("vp.pt", _voice_pt())
    os.link(voice, c.out / "a.mimi")
    return c.reply(c.speech(), c.out / "a.wav", "--voice", voice, "--codes-out",
                   c.out / "a.mimi", "--force", code=OUT, says="a.mimi is also read by this run")


def _manifest_row_writes_an_input(c: Ctx) -> Case:
    c.speech("a.wav")
    c.speech("b.wav")
    rows = (b'{"input": "a.wav", "output": "b.wav"}\n'
            b'{"input": "b.wav", "output": "out/c.wav"}\n')
    return c.reply("--manifest", c.file("m.jsonl", rows), "--force", code=OUT,
                   says="m.jsonl:1: " + str(c.work / "b.wav") + " is also read by this run")


def _manifest_writes_itself(c: Ctx) -> Case:
    c.speech()
    manifest = c.file("m.wav", b'{"input": "speech.wav", "output": "m.wav"}\n')
    return c.reply("--manifest", manifest, "--force", code=OUT,
                   says="m.wav is also read by this run")


def _encode_over_the_checkpoint(c: Ctx) -> Case:
    """The output is a hard link to the model's Mimi checkpoint, under a code file's name."""
    model = c.tiny_copy()
    (checkpoint,) = model.glob("tokenizer-*.safetensors")
    os.link(checkpoint, c.out / "x.npy")
    return c.encode(c.speech(), "-m", model, "-o", c.out / "x.npy", "--force", code=OUT,
                    says="x.npy is also read by this run (as")


def _voice_bytes(dim: int, extra: bool = False) -> bytes:
    """A .pt voice of NVIDIA's layout with embeddings of size `dim` (the golden LM's: 64),
    and with `extra`, a third entry that a voice does not hold."""
    import torch

    voice = {"embeddings": torch.zeros(5, 1, 1, dim),
             "cache": torch.zeros(1, 17, 4, dtype=torch.long)}
    if extra:
        voice["extra"] = torch.zeros(1)
    return _torch_bytes(voice)


def _damagedtgz(c: Ctx) -> Case:
    model = c.golden_model(voices=False)
    (model / VOICES_ARCHIVE).write_bytes(b"not a tar archive\n" * 8)
    return c.reply(c.speech(), c.out / "a.wav", "--voice", "NATF2",
                   env={"XDG_CACHE_HOME": c.work / "cache", "PERSONAPLEX_MODEL": model},
                   code=INVALID, says="is not a readable tar archive")


def _gated(c: Ctx, token: str | None, says: str) -> Case:
    hub = c.shared.hubs["main"]
    repo = "t/gated"
    if repo not in hub.repos:
        hub.add_repo(repo, _hub_files(), gated=True, authorized_tokens={"hf_good"})
    env = {"HF_TOKEN": token} if token else {}
    return c.download("-m", repo, env=env, code=MISSING, says=says)


def _plain_repo(c: Ctx) -> str:
    hub = c.shared.hubs["main"]
    if "t/plain" not in hub.repos:
        hub.add_repo("t/plain", _hub_files(), rejected_tokens={"hf_expired"})
    return "t/plain"


def _repo_without_voices(c: Ctx) -> str:
    files = _hub_files()
    del files[VOICES_ARCHIVE]
    c.shared.hubs["main"].add_repo("t/not-personaplex", files)
    return "t/not-personaplex"


# -- running them -------------------------------------------------------------------------------

def _run(run_cli, work: Path, case: Case):
    """-> (proc, the folder's snapshot afterwards)."""
    env = {"PERSONAPLEX_DEVICE": "cpu", "PERSONAPLEX_VOICES_DIR": work / "my-voices",
           **case.env}
    fds: tuple[int, ...] = ()
    kwargs = {}
    if case.tty == "open-stdin":
        fds = os.pipe()
        kwargs = {"stdin": fds[0], "timeout": 60}
    elif case.tty:
        fds = pty.openpty()
        kwargs = {"stdin": fds[1]} if case.tty == "stdin" else {"stdout": fds[1]}
    try:
        proc = run_cli(*case.args, input=case.stdin, env=env, cwd=work, **kwargs)
    finally:
        for fd in fds:
            os.close(fd)
    return proc, snapshot(work)


class Runs:
    """The chosen cases, built in their folders and running in a small pool."""

    def __init__(self, root: Path, shared: Shared, run_cli):
        self.root = root
        self.shared = shared
        self.run_cli = run_cli
        self.pool = concurrent.futures.ThreadPoolExecutor(WORKERS)
        self.entries: dict[str, tuple] = {}  # name -> (case, work, before, future) or a reason

    def start(self, names: list[str]) -> None:
        for name in names:
            work = self.root / name
            work.mkdir()
            built = CASES[name](Ctx(work, self.shared))
            if isinstance(built, str):
                self.entries[name] = built
                continue
            before = snapshot(work)
            self.entries[name] = (built, work, before,
                                  self.pool.submit(_run, self.run_cli, work, built))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, run_cli, cli_env, tiny_model_dir, speech_wav):
    root = tmp_path_factory.mktemp("errors")
    # A valid .mimi of the speech, made by the CLI itself.
    encoded = root / "speech.mimi"
    proc = run_cli("encode", speech_wav, "-o", encoded,
                   env={"PERSONAPLEX_MODEL": tiny_model_dir, "PERSONAPLEX_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr.decode()
    shared = Shared(root, speech_wav, encoded.read_bytes(), tiny_model_dir,
                    golden_model(root / "golden-model"))
    chosen = [item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and "name" in item.callspec.params]
    for name in ("main", "corrupt", "cut"):
        if any(n.startswith("download-") for n in chosen):
            shared.hubs[name] = HubServer().start()
    result = Runs(root / "cases", shared, run_cli)
    (root / "cases").mkdir()
    try:
        result.start(chosen)
        yield result
    finally:
        result.close()
        for hub in shared.hubs.values():
            hub.stop()
        for cleanup in shared.cleanups:
            cleanup()


@pytest.mark.parametrize("name", list(CASES))
def test_error(name, runs):
    entry = runs.entries[name]
    if isinstance(entry, str):
        pytest.skip(entry)
    case, work, before, future = entry
    proc, after = future.result()
    stderr = proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert proc.returncode == case.code, \
        f"exit {proc.returncode}, expected {case.code}; stderr: {stderr}"
    changes = _differences(before, after)
    if case.code == errors.EXIT_OK:
        assert not changes["gone"] and not changes["changed"], changes  # inputs untouched
        unexpected = [p for p in changes["new"]
                      if not any(p == m or p.startswith(m + os.sep) for m in case.makes)]
        assert not unexpected, f"unexpected new files: {unexpected}"
        if case.check:
            case.check(work, proc)
    else:
        lines = stderr.splitlines()
        if case.code == errors.EXIT_USAGE and len(lines) == 2:
            assert HINT.match(lines[1]), stderr
            lines = lines[:1]
        assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
        assert lines[0].startswith("personaplex: error: "), stderr
        assert case.says in lines[0], f"{case.says!r} not in {lines[0]!r}"
        # Said in words: never a Python exception's name (UnpicklingError, KeyError...).
        assert not PYTHON_EXCEPTION.search(lines[0]), lines[0]
        if proc.stdout is not None:
            assert proc.stdout == b"", proc.stdout[:200]
        assert changes == {"new": [], "gone": [], "changed": []}, changes
    if case.after:
        case.after()

