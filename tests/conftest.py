"""Shared fixtures: a tiny random-weight Mimi model directory, a CLI runner, test audio.

The tests directory goes on sys.path first, so test modules can `import reference`
(Kyutai's moshi-based model builder). `reference` imports torch and moshi, so it is
imported lazily, only by the fixtures that need it.
"""

from __future__ import annotations

import builtins
import json
import os
import struct
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import subprocess  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SAMPLE_RATE = 24000
TINY_MODEL_SEED = 1234
GOLDEN_ASSETS = TESTS_DIR / "data" / "golden" / "assets"

# Variables the user's environment might set that would change what the CLI does.
_SCRUBBED_ENV = (
    "PERSONAPLEX_MODEL", "PERSONAPLEX_DEVICE", "PERSONAPLEX_VOICES_DIR", "PERSONAPLEX_COMPILE",
    "HF_HOME", "HF_HUB_CACHE", "HF_TOKEN", "HF_TOKEN_PATH", "HUGGINGFACE_HUB_CACHE",
    "XDG_CACHE_HOME", "XDG_DATA_HOME", "TYPER_STANDARD_TRACEBACK", "_PERSONAPLEX_COMPLETE",
    "_TYPER_COMPLETE_ARGS", "COMP_WORDS", "COMP_CWORD",
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A model directory holding a tiny random Mimi checkpoint and its arch file."""
    import reference

    folder = tmp_path_factory.mktemp("tiny-model") / "model"
    reference.build_mimi(folder, reference.TINY_MIMI, seed=TINY_MODEL_SEED)
    return folder


def golden_model_folder(root: Path, arch: str = "personaplex-arch.json") -> Path:
    """The golden checkpoints (NVIDIA's tiny random PersonaPlex) as a model folder, with the
    fp32 .pt voice packaged as NATF2."""
    import shutil

    root.mkdir(parents=True)
    for file in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                 "tokenizer_spm_tiny_512.model"):
        (root / file).symlink_to(GOLDEN_ASSETS / file)
    shutil.copy(GOLDEN_ASSETS / arch, root / "personaplex-arch.json")
    (root / "voices").mkdir()
    shutil.copy(GOLDEN_ASSETS / "voice_prompt_fp32.pt", root / "voices" / "NATF2.pt")
    return root


@pytest.fixture(scope="session")
def golden_dir(tmp_path_factory):
    """The golden checkpoints as a ModelDir (the LM, Mimi, the tokenizer, the arch file)."""
    from personaplex_cli.model.files import ModelDir

    folder = tmp_path_factory.mktemp("golden-dir")
    for name in ("model.safetensors", "tokenizer-tiny-mimi.safetensors",
                 "tokenizer_spm_tiny_512.model"):
        (folder / name).symlink_to(GOLDEN_ASSETS / name)
    (folder / "personaplex-arch.json").write_bytes(
        (GOLDEN_ASSETS / "personaplex-arch.json").read_bytes())
    return ModelDir(folder, "golden")


@pytest.fixture(scope="session")
def golden_model(tmp_path_factory):
    """The golden checkpoints loaded on the CPU in fp32 (a personaplex_cli Model)."""
    import torch

    from personaplex_cli.model.files import ModelDir
    from personaplex_cli.model.model import Model

    folder = golden_model_folder(tmp_path_factory.mktemp("golden") / "model")
    return Model(ModelDir(folder, "golden"), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The environment every CLI subprocess starts from: isolated caches, offline hub."""
    base = tmp_path_factory.mktemp("cli-env")
    hf_home = base / "hf-home"  # stays empty: nothing is ever downloaded
    hf_home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update({
        "XDG_CACHE_HOME": str(base / "xdg-cache"),
        "XDG_DATA_HOME": str(base / "xdg-data"),  # never the user's own voices
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_COLOR": "1",
        # One intra-op thread: the tiny model gains nothing from more, and torch's
        # thread pool slows down badly on a busy shared machine (spinning workers).
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        # torch.compile takes minutes a model shape on a busy machine: the commands run
        # eager here; tests/test_depformer.py compiles one small case.
        "PERSONAPLEX_COMPILE": "off",
    })
    return env


FRESH_INTERPRETERS = bool(os.environ.get("PERSONAPLEX_TEST_FRESH_INTERPRETERS"))


@pytest.fixture(scope="session")
def warm_interpreter(cli_env):
    from cli_forks import WarmInterpreter

    warm = WarmInterpreter(cli_env)
    yield warm
    warm.close()


@pytest.fixture(scope="session")
def run_cli(cli_env, warm_interpreter):
    """`run_cli(*args, input=b"", env={...}, cwd=None, timeout=120)` -> CompletedProcess.

    Runs `python -m personaplex_cli ARGS` with real pipes; stdout and stderr are bytes.
    Without `input` (or `stdin`, a file descriptor) stdin is /dev/null. In `env`, a value
    of None removes the variable. `stdout` may name a file descriptor (e.g. a pty).
    The run is a fork of a warm interpreter that has imported torch (tests/cli_forks.py),
    or a fresh interpreter when `env` changes what Python reads as it starts, with
    `fresh=True`, or for every run when PERSONAPLEX_TEST_FRESH_INTERPRETERS is set.
    """
    from cli_forks import needs_fresh_interpreter

    def run(*args, input: bytes | None = None, env: dict | None = None, cwd=None,
            timeout: float = 120, stdin=None, stdout=subprocess.PIPE,
            fresh: bool = False) -> subprocess.CompletedProcess:
        full_env = dict(cli_env)
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = str(value)
        args = [str(arg) for arg in args]
        if not (fresh or FRESH_INTERPRETERS) and not needs_fresh_interpreter(full_env, cli_env):
            return warm_interpreter.run(args, env=full_env, cwd=cwd, input=input,
                                        stdin=stdin, stdout=stdout, timeout=timeout)
        return subprocess.run(
            [sys.executable, "-m", "personaplex_cli", *args],
            input=input, stdin=subprocess.DEVNULL if stdin is None and input is None else stdin,
            stdout=stdout, stderr=subprocess.PIPE, env=full_env, cwd=cwd, timeout=timeout)

    return run


def speech_like(seconds: float, sample_rate: int = SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    """Mono float32 in [-1, 1]: a few harmonics with a gliding pitch and a syllable envelope."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    f0 = 140 + 25 * np.sin(2 * np.pi * 0.7 * t)  # pitch contour
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voice = sum(a * np.sin(k * phase) for k, a in ((1, 0.5), (2, 0.25), (3, 0.15), (5, 0.08)))
    syllables = 0.5 * (1 - np.cos(2 * np.pi * 4 * t))  # 4 per second
    fades = np.minimum(1, 8 * t) * np.minimum(1, 8 * (t[-1] - t))
    envelope = syllables * fades
    noise = 0.01 * rng.standard_normal(len(t))
    return (0.6 * voice * envelope + noise).astype(np.float32)


@pytest.fixture(scope="session")
def speech_wav(tmp_path_factory) -> Path:
    """1.5 s of speech-like audio: 24 kHz mono 16-bit WAV (36000 samples)."""
    import soundfile

    path = tmp_path_factory.mktemp("audio") / "speech.wav"
    soundfile.write(path, speech_like(1.5), SAMPLE_RATE, subtype="PCM_16")
    return path


@pytest.fixture(scope="session")
def speech_wav_44k_stereo(tmp_path_factory) -> Path:
    """The same 1.5 s at 44.1 kHz, stereo (channels slightly different), 16-bit WAV."""
    import soundfile

    mono = speech_like(1.5, 44100)
    stereo = np.stack([mono, 0.8 * mono], axis=1)
    path = tmp_path_factory.mktemp("audio") / "speech-44k1-stereo.wav"
    soundfile.write(path, stereo, 44100, subtype="PCM_16")
    return path




def mimi_with_header(data: bytes, **changes) -> bytes:
    """A .mimi with some JSON header values replaced (the JSON keeps its padded length)."""
    json_len = struct.unpack_from("<I", data, 8)[0]
    header = json.loads(data[20:20 + json_len])
    header.update(changes)
    body = json.dumps(header).encode().ljust(json_len, b" ")
    assert len(body) == json_len
    return data[:20] + body + data[20 + json_len:]


def fail_import(monkeypatch, module: str, error: Exception) -> None:
    """Make `import module` raise `error` for the rest of the test, as when the library or
    the C library under it is not installed."""
    monkeypatch.delitem(sys.modules, module, raising=False)
    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name == module:
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
