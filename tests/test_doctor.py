"""`personaplex doctor`: the real console script in subprocesses, plus the pure pieces.

Each CLI run starts from conftest's isolated environment (empty HF_HOME, XDG cache in a tmp
dir, HF_HUB_OFFLINE=1, NO_COLOR=1); a fake hub cache or model folder is built per test with
small placeholder files (safetensors ones with a valid header, since doctor reads it).
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from personaplex_cli.core.config import PRIMER_ROWS
from personaplex_cli.doctor import compute
from personaplex_cli.doctor.check import FAIL, OK, WARN, Check, exit_status
from personaplex_cli.doctor.hub import check_token
from personaplex_cli.doctor.model import ModelState, check_model, safetensors_header
from personaplex_cli.doctor.compute import (CUDA_TORCH_FIX, Gpu, arch_supported,
                                            check_torch_and_gpus, gpu_memory_needed_gib,
                                            gpu_verdict)
from personaplex_cli.doctor.serve import check_serve
from personaplex_cli.errors import (EXIT_AUDIO_DEVICE, EXIT_DEVICE, EXIT_MODEL_INVALID,
                                    EXIT_MODEL_MISSING, EXIT_OK)
from personaplex_cli.model.files import HUB_FILES, LM_FILE, MIMI_FILE, TOKENIZER_FILE
from personaplex_cli.model.voices_archive import format_size

REPO_FOLDER = "models--nvidia--personaplex-7b-v1"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
VOICES = ("NATF2.pt", "NATM0.pt", "VARF1.pt")
TOKEN = "hf_DoctorTestTokenMustNeverBePrinted0123"


def safetensors_bytes(n_tensors: int) -> bytes:
    """A valid little .safetensors file: n F32 scalars."""
    header = {"__metadata__": {"format": "pt"}}
    for i in range(n_tensors):
        header[f"t{i}"] = {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"\0" * (4 * n_tensors)


def placeholder(name: str) -> bytes:
    if name == LM_FILE:
        return safetensors_bytes(475)
    if name.endswith(".safetensors"):
        return safetensors_bytes(12)
    return (name.encode() + b"\n") * 40


def make_hub_cache(root: Path, files=HUB_FILES, voices=VOICES) -> Path:
    """The hub layout: refs/main, blobs/<sha256>, snapshots/<commit>/<name> -> blob."""
    storage = root / REPO_FOLDER
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    (storage / "blobs").mkdir()
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in files:
        data = placeholder(name)
        digest = hashlib.sha256(data).hexdigest()
        (storage / "blobs" / digest).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", digest))
    if voices:
        (snapshot / "voices").mkdir()
        for voice in voices:
            (snapshot / "voices" / voice).write_bytes(b"voice")
    return snapshot


def make_folder(folder: Path, files=HUB_FILES, voices=VOICES) -> Path:
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(placeholder(name))
    if voices:
        (folder / "voices").mkdir()
        for voice in voices:
            (folder / "voices" / voice).write_bytes(b"voice")
    return folder


def doctor(run_cli, *args, env=None, human=False):
    """(exit code, {name: check} from --json, human stdout, stderr of the last run).

    With `human`, doctor also runs without --json (each run costs a torch import)."""
    as_json = run_cli("doctor", "--json", *args, env=env)
    runs = [as_json]
    if human:
        runs.append(run_cli("doctor", *args, env=env))
    for proc in runs:
        assert b"Traceback" not in proc.stderr, proc.stderr.decode()
        assert proc.returncode == as_json.returncode
    lines = as_json.stdout.decode().splitlines()
    assert len(lines) == 1, as_json.stdout  # one line of JSON, nothing else on stdout
    checks = json.loads(lines[0])
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in checks)
    by_name = {c["name"]: c for c in checks}
    assert len(by_name) == len(checks)
    last = runs[-1]
    return last.returncode, by_name, last.stdout.decode(), last.stderr.decode()


def human_lines(stdout: str) -> dict[str, tuple[str, str, str | None]]:
    """name -> (status, detail, fix) parsed back from the aligned text."""
    found: dict[str, list] = {}
    last = None
    for line in stdout.splitlines():
        if line.startswith(" "):
            assert last is not None and line.strip().startswith("fix: "), line
            found[last][2] = line.strip()[len("fix: "):]
            continue
        status, name, detail = line.split(None, 2)
        assert status in (OK, WARN, FAIL), line
        found[name] = [status, detail, None]
        last = name
    return {k: tuple(v) for k, v in found.items()}


# -- this machine as it is ----------------------------------------------------------------------

def test_this_machine_as_it_is(run_cli):
    import torch

    code, checks, stdout, stderr = doctor(run_cli, human=True)
    assert "\x1b" not in stdout  # plain text: NO_COLOR, and stdout is a pipe
    human = human_lines(stdout)
    assert list(human) == list(checks)  # the same checks, in the same order
    for name, (status, detail, fix) in human.items():
        assert (status, detail) == (checks[name]["status"], checks[name]["detail"])
        assert fix == (checks[name]["fix"] if status != OK else None)
        if status != OK:
            assert checks[name]["fix"], name  # every warning and failure says what to do

    python = checks["python"]
    assert python["status"] == OK
    assert python["detail"].startswith(".".join(map(str, sys.version_info[:3])) + " ")

    assert torch.__version__ in checks["torch"]["detail"]
    if torch.version.cuda is None:
        assert "(CPU build)" in checks["torch"]["detail"]
    else:
        assert f"CUDA {torch.version.cuda} build" in checks["torch"]["detail"]

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        gpu = checks["gpu"]
        assert gpu["status"] == WARN  # no GPU is a warning: the file commands still work
        assert "encode and decode run fine on the CPU" in gpu["detail"]
        assert "talk cannot keep up" in gpu["detail"]
        need = gpu_memory_needed_gib("bf16")
        assert f"{need:.1f} GiB" in gpu["fix"] and "estimate" in gpu["fix"]
    else:
        assert {f"gpu{i}" for i in range(gpus)} <= set(checks)

    try:
        import sounddevice as sd
    except OSError:
        assert checks["portaudio"]["status"] == FAIL
        assert "libportaudio2" in checks["portaudio"]["fix"]
    else:
        assert checks["portaudio"]["status"] == OK
        assert sd.__version__ in checks["portaudio"]["detail"]
        if not sd.query_devices():
            assert checks["audio-devices"]["status"] == WARN
            assert "no audio devices" in checks["audio-devices"]["detail"]
        else:
            d_in = sd.default.device[0]
            if d_in is not None and d_in >= 0:
                assert f"input #{d_in} " in checks["audio-devices"]["detail"]

    try:
        import pywebrtc_audio  # noqa: F401
    except ImportError:
        assert checks["echo-cancel"]["status"] == WARN
    else:
        assert checks["echo-cancel"]["status"] == OK

    assert checks["serve"]["status"] in (OK, WARN)  # WARN only when port 8998 is taken
    assert "uvicorn" in checks["serve"]["detail"] and "sphn" in checks["serve"]["detail"]

    model = checks["model"]
    assert model["status"] == FAIL
    assert "not in the Hugging Face cache" in model["detail"]
    assert "personaplex download" in model["fix"]
    assert "HF_HUB_OFFLINE" in model["fix"]  # conftest runs offline: say to unset it
    token = checks["hf-token"]
    assert token["status"] == WARN and "no Hugging Face token" in token["detail"]
    assert "hf auth login" in token["fix"] and "HF_TOKEN" in token["fix"]
    assert "https://huggingface.co/nvidia/personaplex-7b-v1" in token["fix"]
    disk = checks["disk"]
    assert "the download still needs 17.1 GB" in disk["detail"]
    # a machine with less free space than that fails this check too, with its own fix
    assert disk["status"] in (OK, FAIL)
    if disk["status"] == FAIL:
        assert "HF_HUB_CACHE" in disk["fix"]

    # The model is the first failure here: exit 3, whatever the audio and GPU say.
    first_fail = next(c for c in checks.values() if c["status"] == FAIL)
    assert first_fail["name"] == "model"
    assert code == EXIT_MODEL_MISSING
    failed = sum(c["status"] == FAIL for c in checks.values())
    assert f"personaplex doctor: {failed} failed, " in stderr  # the summary goes to stderr


def test_quiet_prints_only_failures(run_cli):
    proc = run_cli("doctor", "-q")
    assert proc.returncode == EXIT_MODEL_MISSING
    lines = proc.stdout.decode().splitlines()
    assert lines[0].startswith("fail model ")
    assert all(line.startswith(("fail", " ")) for line in lines)
    assert b"personaplex doctor:" not in proc.stderr  # no summary either (PortAudio's own
    # C library may still print on stderr where ALSA is configured oddly)


# -- a model in the hub cache ------------------------------------------------------------

def test_complete_hub_cache_is_ok(run_cli, tmp_path):
    snapshot = make_hub_cache(tmp_path / "hub")
    code, checks, stdout, _ = doctor(run_cli, env={"HF_HUB_CACHE": tmp_path / "hub"}, human=True)
    model = checks["model"]
    assert model["status"] == OK, model
    assert human_lines(stdout)["model"] == (OK, model["detail"], None)
    for name in HUB_FILES:
        assert f"{name} {format_size((snapshot / name).stat().st_size)}" in model["detail"]
    assert "475 tensors" in model["detail"]
    assert "voices/ 3 voices" in model["detail"]
    assert model["detail"].endswith("complete")
    assert COMMIT[:12] in model["detail"]
    # Downloaded: no token needed, nothing to download.
    assert checks["hf-token"]["status"] == OK and "not needed" in checks["hf-token"]["detail"]
    assert "nothing left to download" in checks["disk"]["detail"]
    # Warnings (no GPU, no audio device here) leave the exit status at 0.
    fails = [c["name"] for c in checks.values() if c["status"] == FAIL]
    assert (code == EXIT_OK) == (not fails), fails


def test_hub_cache_missing_one_file_fails_naming_it(run_cli, tmp_path):
    files = [name for name in HUB_FILES if name != TOKENIZER_FILE]
    make_hub_cache(tmp_path / "hub", files=files)
    code, checks, _, _ = doctor(run_cli, env={"HF_HUB_CACHE": tmp_path / "hub"})
    assert checks["serve"]["status"] in (OK, WARN)  # WARN only when port 8998 is taken
    assert "uvicorn" in checks["serve"]["detail"] and "sphn" in checks["serve"]["detail"]

    model = checks["model"]
    assert model["status"] == FAIL
    assert f"missing {TOKENIZER_FILE}" in model["detail"]
    assert TOKENIZER_FILE in model["fix"] and "personaplex download" in model["fix"]
    assert MIMI_FILE in model["detail"]  # the files that are there are still listed
    assert "the download still needs 553.0 kB" in checks["disk"]["detail"]
    assert code == EXIT_MODEL_MISSING


def test_truncated_language_model_is_invalid(run_cli, tmp_path):
    snapshot = make_hub_cache(tmp_path / "hub")
    blob = (snapshot / LM_FILE).resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[:-100])
    code, checks, _, _ = doctor(run_cli, env={"HF_HUB_CACHE": tmp_path / "hub"})
    assert checks["model"]["status"] == FAIL
    assert f"{LM_FILE} is truncated" in checks["model"]["detail"]
    assert "personaplex download" in checks["model"]["fix"]
    assert code == EXIT_MODEL_INVALID


def test_verify_finds_a_blob_damaged_after_the_download(run_cli, tmp_path):
    """A changed byte keeps the header whole (plain doctor: ok); --verify reads each file
    against the sha256 its blob is named by (issue 20.4)."""
    snapshot = make_hub_cache(tmp_path / "hub")
    env = {"HF_HUB_CACHE": tmp_path / "hub"}
    _, checks, _, _ = doctor(run_cli, "--verify", env=env)
    assert checks["model"]["status"] == OK
    assert checks["model"]["detail"].endswith("each file matching the hub's sha256")
    blob = (snapshot / MIMI_FILE).resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert doctor(run_cli, env=env)[1]["model"]["status"] == OK
    code, checks, _, _ = doctor(run_cli, "--verify", env=env)
    assert checks["model"]["status"] == FAIL
    assert f"{MIMI_FILE} does not match the sha256 the hub gives" in checks["model"]["detail"]
    assert "personaplex download" in checks["model"]["fix"]
    assert code == EXIT_MODEL_INVALID


# -- the token -------------------------------------------------------------------------------

def test_token_in_hf_token_is_reported_never_printed(run_cli):
    env = {"HF_TOKEN": TOKEN}
    _, checks, stdout, stderr = doctor(run_cli, "-vv", env=env, human=True)
    token = checks["hf-token"]
    assert token["status"] == OK and "HF_TOKEN environment variable" in token["detail"]
    assert "HF_TOKEN" in stdout
    for part in (TOKEN, TOKEN[3:], TOKEN[-8:], TOKEN[:8]):
        assert part not in stdout and part not in stderr
        assert part not in json.dumps(checks)


@pytest.mark.parametrize("how", ["HF_TOKEN_PATH", "HF_HOME"])
def test_token_file_is_reported_never_printed(run_cli, tmp_path, cli_env, how):
    if how == "HF_TOKEN_PATH":
        path = tmp_path / "elsewhere" / "my-token"
        env = {"HF_TOKEN_PATH": path}
    else:
        path = Path(cli_env["HF_HOME"]).parent / "hf-home-with-token" / "token"
        env = {"HF_HOME": path.parent}
    path.parent.mkdir(parents=True)
    path.write_text(TOKEN + "\n")
    _, checks, stdout, stderr = doctor(run_cli, "-v", env=env, human=True)
    token = checks["hf-token"]
    assert token["status"] == OK, token
    assert str(path) in token["detail"]
    assert TOKEN not in stdout + stderr and TOKEN[-8:] not in stdout + stderr


# -- a model folder ------------------------------------------------------------------------------

def test_model_folder(run_cli, tmp_path):
    folder = make_folder(tmp_path / "my model")
    code, checks, _, _ = doctor(run_cli, "--model", folder)
    model = checks["model"]
    assert model["status"] == OK, model
    assert str(folder) in model["detail"]
    for name in HUB_FILES[:3]:
        assert f"{name} {format_size((folder / name).stat().st_size)}" in model["detail"]
    assert "voices/ 3 voices" in model["detail"]
    assert checks["hf-token"]["status"] == OK  # a folder needs no token
    assert "--model is a folder" in checks["disk"]["detail"]
    fails = [c["name"] for c in checks.values() if c["status"] == FAIL]
    assert (code == EXIT_OK) == (not fails), fails


def test_model_folder_with_only_mimi(run_cli, tmp_path):
    folder = make_folder(tmp_path / "mimi-only", files=[MIMI_FILE], voices=())
    proc = run_cli("doctor", "--json", "--model", folder)
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["serve"]["status"] in (OK, WARN)  # WARN only when port 8998 is taken
    assert "uvicorn" in checks["serve"]["detail"] and "sphn" in checks["serve"]["detail"]

    model = checks["model"]
    assert model["status"] == FAIL
    assert LM_FILE in model["detail"] and TOKENIZER_FILE in model["detail"]
    assert "encode and decode will work" in model["detail"]
    assert "reply, talk and voices create will not" in model["detail"]
    assert proc.returncode == EXIT_MODEL_MISSING


def test_model_folder_without_voices_is_a_warning_that_says_what_works(run_cli, tmp_path):
    """Issue 13.12: everything but a packaged voice by name works with such a folder."""
    folder = make_folder(tmp_path / "no voices", files=HUB_FILES[:3], voices=())
    code, checks, stdout, _ = doctor(run_cli, "--model", folder, human=True)
    model = checks["model"]
    assert model["status"] == WARN, model
    assert human_lines(stdout)["model"] == (WARN, model["detail"], model["fix"])
    assert model["detail"].endswith(
        "; no packaged voices (voices/ or voices.tgz): encode, decode and voices create work, "
        "and reply and talk with --voice FILE or --voice ''; a packaged voice by name (the "
        "default NATF2 among them) does not")
    assert model["fix"] == (f"copy voices/ or voices.tgz of nvidia/personaplex-7b-v1 into "
                            f"{folder}; or give --voice FILE (a .pt or .wav) or --voice '' "
                            "(none)")
    assert checks["hf-token"]["status"] == OK
    fails = [c["name"] for c in checks.values() if c["status"] == FAIL]
    assert (code == EXIT_OK) == (not fails), fails


def test_voices_unpacked_on_first_use_are_reported(tmp_path, monkeypatch):
    """Issue 13.12: once a command has unpacked a folder's voices.tgz into our cache, doctor
    says so (it said "not unpacked yet" for ever); a changed archive is unpacked again."""
    from hub_server import tgz
    from personaplex_cli.model.files import VOICES_ARCHIVE, ModelDir, unpacked_voices_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = make_folder(tmp_path / "with archive", files=HUB_FILES[:3], voices=())
    archive = folder / VOICES_ARCHIVE
    archive.write_bytes(tgz([("voices", None), ("voices/NATF2.pt", b"a"),
                             ("voices/NATM0.pt", b"b")]))
    check, _ = check_model(str(folder))
    assert check.status == OK, check
    assert "voices/ not unpacked yet (done on first use)" in check.detail

    ModelDir(folder, str(folder)).voices_dir()  # what reply, talk and voices do first
    check, _ = check_model(str(folder))
    assert check.status == OK, check
    assert (f"voices/ 2 voices (unpacked from voices.tgz into {unpacked_voices_dir(archive)})"
            in check.detail)
    assert "not unpacked" not in check.detail

    archive.write_bytes(tgz([("voices", None), ("voices/NATF2.pt", b"new")]))
    check, _ = check_model(str(folder))
    assert "voices/ not unpacked yet (done on first use)" in check.detail

    # An empty voices/ is what the commands use, archive or not: no voices.
    (folder / "voices").mkdir()
    check, _ = check_model(str(folder))
    assert check.status == WARN and "voices/ 0 voices" in check.detail, check
    assert exit_status([check]) == EXIT_OK


def test_model_folder_that_does_not_exist(run_cli, tmp_path):
    proc = run_cli("doctor", "--json", "--model", tmp_path / "nowhere")
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["model"]["status"] == FAIL
    assert "does not exist" in checks["model"]["detail"]
    assert proc.returncode == EXIT_MODEL_MISSING
    assert b"Traceback" not in proc.stderr


def test_model_folder_with_two_mimi_files_is_invalid_not_missing(tmp_path):
    folder = make_folder(tmp_path / "two mimis")
    (folder / MIMI_FILE).rename(folder / "tokenizer-a.safetensors")
    (folder / "tokenizer-b.safetensors").write_bytes(placeholder(MIMI_FILE))
    # Without the published name the two candidates tie.
    check, _ = check_model(str(folder))
    assert check.status == FAIL and check.exit_code == EXIT_MODEL_INVALID, check
    assert "has several files for the Mimi codec checkpoint" in check.detail
    assert "missing" not in check.detail


def test_token_fix_names_the_licence_page_of_the_repo_asked_for(tmp_path, monkeypatch):
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    check = check_token(ModelState("hub", False, 0, "someone/other-model"))
    assert check.status == WARN
    assert "https://huggingface.co/someone/other-model," in check.fix


# -- GPU memory arithmetic -------------------------------------------------------------------

def test_memory_arithmetic():
    bf16 = gpu_memory_needed_gib("bf16")
    fp32 = gpu_memory_needed_gib("fp32")
    int8 = gpu_memory_needed_gib("bf16", quantize="int8")
    # Weights 14.3 GiB, the caller's KV window 1.47 (one stream primes in its own row),
    # Mimi, 2 GiB margin.
    assert 17.5 <= bf16 <= 19.0
    assert gpu_memory_needed_gib("fp16") == bf16
    assert 1.8 * bf16 <= fp32 <= 2.0 * bf16
    # int8 takes a byte off each of the transformers' 7.19 B weights, nothing off the KV.
    assert abs(bf16 - int8 - 7.19e9 / 2 ** 30) < 0.05
    # Each more stream adds one KV window: 32 layers x (K, V) x 3001 slots x 4096 x 2 B,
    # plus Mimi's two small rings; a second stream brings the primer of two rows, and up to
    # core.config.PRIMER_ROWS streams it grows by a row with them (two windows a stream),
    # past it by none.
    kv_bf16 = 32 * 2 * 3001 * 4096 * 2 / 2 ** 30
    extra = gpu_memory_needed_gib("bf16", streams=2) - bf16
    assert 3 * kv_bf16 < extra < 3 * (kv_bf16 + 0.02)
    third = gpu_memory_needed_gib("bf16", streams=3) - gpu_memory_needed_gib("bf16", streams=2)
    assert 2 * kv_bf16 < third < 2 * (kv_bf16 + 0.02)
    past = (gpu_memory_needed_gib("bf16", streams=PRIMER_ROWS + 1)
            - gpu_memory_needed_gib("bf16", streams=PRIMER_ROWS))
    assert kv_bf16 < past < kv_bf16 + 0.02
    assert (gpu_memory_needed_gib("bf16", streams=2, quantize="int8") - int8
            == pytest.approx(extra))
    # int4: half a byte a weight and a scale and zero per 64, so between int8 and half of it
    int4 = gpu_memory_needed_gib("bf16", quantize="int4")
    assert abs(int8 - int4 - 7.19e9 * (0.5 - 4 / 64) / 2 ** 30) < 0.05
    with pytest.raises(ValueError):
        gpu_memory_needed_gib("int4")
    with pytest.raises(ValueError):
        gpu_memory_needed_gib("bf16", quantize="int2")


def test_no_gpu_line_uses_the_memory_figure_of_the_dtype(run_cli):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        pytest.skip("this machine has a GPU: the no-GPU line is not printed")
    proc = run_cli("doctor", "--json", "--dtype", "fp32")
    gpu = {c["name"]: c for c in json.loads(proc.stdout)}["gpu"]
    need = gpu_memory_needed_gib("fp32")
    assert f"{need:.1f} GiB free at fp32" in gpu["fix"]


def test_the_default_dtype_is_the_one_each_device_runs(run_cli):
    """Without --dtype, the GPU advice counts bf16 (CUDA's default) and the CPU line the
    precision reply takes on this CPU (model/device.py), as `doctor -h` says (issue 20.13)."""
    import torch

    from personaplex_cli.model.device import default_dtype_name

    help_text = " ".join(run_cli("doctor", "-h", env={"TERMINAL_WIDTH": "200"}
                                 ).stdout.decode().split())
    assert "bf16 on CUDA and on CPUs with native bf16, else fp32" in help_text
    if torch.cuda.is_available() and torch.cuda.device_count():
        pytest.skip("this machine has a GPU: the no-GPU line is not printed")
    gpu = {c["name"]: c for c in json.loads(run_cli("doctor", "--json").stdout)}["gpu"]
    cpu_dtype = default_dtype_name("cpu")
    assert f"on this CPU the model runs at {cpu_dtype} in about" in gpu["detail"]
    assert f"{gpu_memory_needed_gib('bf16'):.1f} GiB free at bf16" in gpu["fix"]


GIB = 2 ** 30
ARCH_CU124 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def test_gpu_verdicts():
    need = gpu_memory_needed_gib("bf16") * GIB
    h200 = Gpu(0, "NVIDIA H200", (9, 0), int(139.8 * GIB), int(139 * GIB))
    ok = gpu_verdict(h200, ARCH_CU124, "bf16")
    assert ok.status == OK and "NVIDIA H200 (sm_90)" in ok.detail
    assert "counted from the architecture" in ok.detail
    assert f"{need / GIB:.1f} GiB" in ok.detail

    blackwell = Gpu(0, "NVIDIA GeForce RTX 5090", (12, 0), 32 * GIB, 31 * GIB)
    fail = gpu_verdict(blackwell, ARCH_CU124, "bf16")
    assert fail.status == FAIL and fail.exit_code == EXIT_DEVICE
    assert "sm_120" in fail.detail
    assert fail.fix == CUDA_TORCH_FIX
    assert "whl/cu128" in fail.fix and "12.8" in fail.fix
    assert gpu_verdict(blackwell, ARCH_CU124 + ["sm_100", "sm_120"], "bf16").status == OK
    # Machine code runs on later minors of the same major (8.6 and 8.9 from sm_80; GB10's
    # 12.1 from sm_120), not on an earlier one, and PTX does not count.
    assert arch_supported((8, 9), ["sm_80"])
    assert arch_supported((12, 1), ["sm_120"])
    assert not arch_supported((8, 0), ["sm_86"])
    assert not arch_supported((12, 0), ["sm_90", "compute_90"])
    assert arch_supported((9, 0), ["sm_90a"])

    small = Gpu(0, "NVIDIA GeForce RTX 4080", (8, 9), 16 * GIB, 15 * GIB)
    too_small = gpu_verdict(small, ARCH_CU124, "bf16")
    assert too_small.status == FAIL and too_small.exit_code == EXIT_DEVICE
    # 16 GB holds the int8 model (about 11.5 GiB, its CUDA graphs' 3 MiB included: one
    # stream, one window) but not the bf16 one (18.2).
    assert "use --quantize int8 (about 11.5 GiB)" in too_small.fix
    assert gpu_verdict(small, ARCH_CU124, "bf16", "int8").status == OK
    tiny = Gpu(0, "NVIDIA T4", (7, 5), 8 * GIB, 8 * GIB)
    assert "--device cpu" in gpu_verdict(tiny, ARCH_CU124, "bf16").fix
    # int4 (about 8.5 GiB with its CUDA margin) fits 10 GB where int8 does not, from Ampere on
    card10 = Gpu(0, "NVIDIA GeForce RTX 3080", (8, 6), 10 * GIB, 10 * GIB)
    assert "use --quantize int4 (about " in gpu_verdict(card10, ARCH_CU124, "bf16").fix
    assert gpu_verdict(card10, ARCH_CU124, "bf16", "int4").status == OK
    old = Gpu(0, "NVIDIA Tesla V100 (a 10 GiB share)", (7, 0), 10 * GIB, 10 * GIB)
    no_int4 = gpu_verdict(old, ARCH_CU124, "bf16", "int4")
    assert no_int4.status == FAIL and "int4 needs compute capability 8.0" in no_int4.detail
    assert "--device cpu" in gpu_verdict(old, ARCH_CU124, "bf16").fix
    no_fp8 = gpu_verdict(Gpu(0, "NVIDIA A100", (8, 0), 80 * GIB, 80 * GIB),
                         ARCH_CU124, "bf16", "fp8")
    assert no_fp8.status == FAIL and "--quantize int8" in no_fp8.fix
    assert gpu_verdict(small, ARCH_CU124, "bf16", "fp8").status == OK

    busy = Gpu(0, "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB, 10 * GIB)
    assert gpu_verdict(busy, ARCH_CU124, "bf16").status == WARN
    # fp32 needs about 34 GiB: a 24 GB card is fine at bf16, too small at fp32.
    card24 = Gpu(0, "NVIDIA L4", (8, 9), int(22.5 * GIB), 22 * GIB)
    assert gpu_verdict(card24, ARCH_CU124, "bf16").status == OK
    assert gpu_verdict(card24, ARCH_CU124, "fp32").status == FAIL


def test_exit_status_is_the_first_failure():
    checks = [Check("a", OK, ""), Check("b", WARN, "", "x"),
              Check("c", FAIL, "", "y", EXIT_AUDIO_DEVICE), Check("d", FAIL, "", "z", EXIT_DEVICE)]
    assert exit_status(checks) == EXIT_AUDIO_DEVICE
    assert exit_status(checks[:2]) == EXIT_OK


def test_safetensors_header(tmp_path):
    good = tmp_path / "good.safetensors"
    good.write_bytes(safetensors_bytes(5))
    assert safetensors_header(good) == (5, None)
    short = tmp_path / "short.safetensors"
    short.write_bytes(safetensors_bytes(5)[:-1])
    count, problem = safetensors_header(short)
    assert problem.startswith("truncated")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"<html>this is a login page, not a model</html>")
    assert safetensors_header(junk)[1].startswith("not a safetensors file")


# -- imports: fast and offline ------------------------------------------------------------------

_PROBE = """
import json, os, sys
sys.argv = ["personaplex", *json.loads(os.environ["PROBE_ARGV"])]
from personaplex_cli.cli.app import main
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})), file=sys.stderr)
"""


@pytest.mark.parametrize("argv,forbidden", [
    (["doctor", "--help"], {"torch", "numpy", "sounddevice", "huggingface_hub"}),
    (["doctor", "--json"], {"huggingface_hub", "safetensors", "requests", "httpx"}),
], ids=["help", "run"])
def test_imports(cli_env, argv, forbidden):
    proc = subprocess.run([sys.executable, "-c", _PROBE], stdin=subprocess.DEVNULL,
                          env={**cli_env, "PROBE_ARGV": json.dumps(argv)},
                          capture_output=True, timeout=120, check=False)
    loaded = set(json.loads(proc.stderr.decode().splitlines()[-1]))
    assert not loaded & forbidden, sorted(loaded & forbidden)
    if argv[-1] == "--help":
        assert b"doctor" in proc.stdout


import personaplex_cli.model.memory  # noqa: E402,F401  (with the real torch, before FakeTorch)


class FakeTorch:
    """Just what check_torch_and_gpus asks of torch, for GPUs this machine does not have."""

    def __init__(self, cuda, arch, gpus):
        from types import SimpleNamespace as NS

        self.__version__ = "2.4.1" if cuda else "2.4.1+cpu"
        self.version = NS(cuda=cuda, hip=None)
        self.cuda = NS(
            is_available=lambda: bool(gpus), device_count=lambda: len(gpus),
            get_arch_list=lambda: list(arch),
            get_device_properties=lambda i: NS(name=gpus[i][0], major=gpus[i][1][0],
                                               minor=gpus[i][1][1], total_memory=gpus[i][2]),
            mem_get_info=lambda i: (gpus[i][3], gpus[i][2]))


def test_gpu_path_with_a_fake_torch(monkeypatch):
    monkeypatch.setattr(compute, "nvidia_visible", lambda: "/proc/driver/nvidia")
    gpus = [("NVIDIA GeForce RTX 5090", (12, 0), 32 * GIB, 31 * GIB)]
    monkeypatch.setitem(sys.modules, "torch", FakeTorch("12.4", ARCH_CU124, gpus))
    torch_check, gpu = check_torch_and_gpus("bf16")
    assert torch_check.status == OK and "CUDA 12.4 build" in torch_check.detail
    assert gpu.name == "gpu0" and gpu.status == FAIL and gpu.exit_code == EXIT_DEVICE
    assert gpu.fix == CUDA_TORCH_FIX
    assert exit_status([torch_check, gpu]) == EXIT_DEVICE

    gpus = [("NVIDIA H200", (9, 0), int(139.8 * GIB), 139 * GIB),
            ("NVIDIA T400", (7, 5), 4 * GIB, 4 * GIB)]
    monkeypatch.setitem(sys.modules, "torch", FakeTorch("12.4", ARCH_CU124, gpus))
    _, big, small = check_torch_and_gpus("bf16")
    assert big.status == OK and "NVIDIA H200 (sm_90), 139.8 GiB, 139.0 GiB free" in big.detail
    assert small.status == WARN and "--device cuda:0" in small.fix  # the other GPU fits

    # A CPU build of torch on a machine with an NVIDIA driver: install the CUDA build.
    monkeypatch.setitem(sys.modules, "torch", FakeTorch(None, [], []))
    torch_check, gpu = check_torch_and_gpus("bf16")
    assert torch_check.status == WARN and "(CPU build)" in torch_check.detail
    assert "download.pytorch.org/whl/cu128" in torch_check.fix
    assert gpu.status == WARN and "no CUDA GPU usable by torch" in gpu.detail


def test_fp32_on_a_card_that_fits_bf16():
    card24 = Gpu(0, "NVIDIA L4", (8, 9), int(22.5 * GIB), 22 * GIB)
    verdict = gpu_verdict(card24, ARCH_CU124, "fp32")
    assert verdict.status == FAIL and "--dtype bf16" in verdict.fix


def test_serve_check_names_what_is_missing(monkeypatch):
    from conftest import fail_import

    fail_import(monkeypatch, "uvicorn", ImportError("No module named 'uvicorn'"))
    check = check_serve()
    assert check.status == WARN and "uvicorn" in check.detail
    assert check.fix == "pip install uvicorn"


def test_threads_are_reported_as_remembered(run_cli, tmp_path):
    """doctor reads the one remembered decision serve, talk and reply share."""
    from personaplex_cli.runtime.warmup import Threads, ThreadsMemory

    cache = tmp_path / "cache"
    env = {"XDG_CACHE_HOME": cache}
    _, checks, _, _ = doctor(run_cli, env=env)
    assert checks["threads"]["status"] == OK
    assert checks["threads"]["detail"].startswith("not measured yet on this machine")
    import os

    cores = os.cpu_count() or 1
    ThreadsMemory.of(cache / "personaplex", "cpu", "torch.float32", "none", "abc",
                     cores=cores).remember(Threads(1, {1: 8.0, 2: 230.0}))
    _, checks, _, _ = doctor(run_cli, env=env)
    assert checks["threads"]["detail"] == (
        f"cpu/float32/none/model abc/{cores} cores: 1 torch thread "
        "(the fastest step: 8 ms on 1, 230 ms on 2)")


def test_memory_figures_are_the_models_given_with_m(tmp_path):
    """`doctor -m DIR` counts the memory of DIR's architecture (it quoted the 7B's 18.6 GiB
    for the tiny test model), and a size under a tenth of a GiB is said in MiB ("0.0 GiB
    weights" said nothing): issue 30.15."""
    from conftest import golden_model_folder

    from personaplex_cli.doctor.run import run_checks
    from personaplex_cli.model.memory import GIB, gib

    folder = golden_model_folder(tmp_path / "tiny")
    arch = compute.model_arch(str(folder))
    assert arch is not None and compute.model_arch("nvidia/personaplex-7b-v1") is None
    tiny = compute.gpu_memory_needed_gib("bf16", arch=arch)
    published = compute.gpu_memory_needed_gib("bf16")
    assert tiny < published / 5
    said = " ".join(check.detail + " " + (check.fix or "")
                    for check in run_checks(str(folder)) if check.name.startswith("gpu"))
    assert gib(published * GIB) not in said and gib(tiny * GIB) in said, said
    assert gib(5 * 1024 ** 2) == "5.0 MiB" and gib(2 * GIB) == "2.0 GiB"
