"""What `personaplex doctor` checks: plain functions, each returning `Check`s.

Nothing here prints, downloads or loads model weights: the model's files are looked at with
`stat` (and the safetensors header, which is JSON at the start of the file), the hub cache
is read the way `model/files.py` reads it, and huggingface_hub is never imported. torch,
sounddevice and the echo canceller's library are imported inside the checks that need them.

A check's status is one of:
  ok    nothing to do;
  warn  something is missing that some work can do without (no GPU: the file commands still
        run on the CPU; no microphone; no echo canceller: `talk --no-echo-cancel`; no token
        while the model is not downloaded yet);
  fail  something a command needs is broken or missing; `exit_code` says which kind (the
        constants of `errors.py`), and `fix` says what to do about it.
The rule between the two: hardware that is simply absent is a warning that says what still
works; software that is installed wrongly, or a model that is missing, is a failure.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .core.config import QUANTIZE_MODES, SAMPLE_RATE
from .errors import (EXIT_AUDIO_DEVICE, EXIT_DEVICE, EXIT_FAILURE, EXIT_MODEL_INVALID,
                     EXIT_MODEL_MISSING, EXIT_OK, EXIT_OUTPUT)
from .model.files import (DEFAULT_MODEL, HUB_FILES, LM_FILE, MIMI_FILE, MIMI_ONLY,
                          TOKENIZER_FILE, VOICES_ARCHIVE, VOICES_DIR, download_hint,
                          existing_parent, hf_home, licence_url)

OK, WARN, FAIL = "ok", "warn", "fail"
MIN_PYTHON = (3, 10)  # pyproject's requires-python
CUDA_TORCH_FIX = ("install a torch build for CUDA 12.8+, e.g. "
                  "pip install torch --index-url https://download.pytorch.org/whl/cu128")



@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str  # what was found, one line
    fix: str | None = None  # for WARN and FAIL: what to do, one line
    exit_code: int = EXIT_OK  # for FAIL: the exit status it stands for

    def as_json(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def exit_status(checks: list[Check]) -> int:
    """0 when no check failed (warnings allowed), else the exit code of the first failure."""
    return next((c.exit_code or EXIT_FAILURE for c in checks if c.status == FAIL), EXIT_OK)


# -- the memory arithmetic: model/memory.py's, for PersonaPlex's architecture ------------------

GIB = 1024 ** 3
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
LM_CHECKPOINT_BYTES = 16_742_874_608  # model.safetensors: 8.37 B bf16 values and a header

# What `personaplex download` fetches, by file (bytes; estimates for the disk check): the LM
# in bf16, Mimi in fp32 (385 MB), the SentencePiece model 553 kB, the 18 voices a few MB
# (reference-personaplex.md §1.5, §2.2).
HUB_FILE_BYTES = {LM_FILE: LM_CHECKPOINT_BYTES, MIMI_FILE: 385_000_000,
                  TOKENIZER_FILE: 553_000, VOICES_ARCHIVE: 10_000_000}


def gpu_memory_needed_gib(dtype: str = "bf16", streams: int = 1, quantize: str = "none"
                          ) -> float:
    """GPU memory PersonaPlex needs for `streams` streams, in GiB, by model/memory.py: the
    weights and KV rings counted from the architecture (only the 8 assistant depformer steps
    are loaded; the KV stays at `dtype` whatever the quantization), Mimi in fp32, and a CUDA
    margin that is an estimate until measured on a GPU."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantization {quantize!r}")
    from .model.memory import personaplex_need

    need = personaplex_need(dtype, quantize, streams)
    return need.total / GIB


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _size(n: int) -> str:
    from .model.voices_archive import format_size

    return format_size(n)


# -- Python and torch ------------------------------------------------------------------------

def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    detail = f"{version} ({sys.executable})"
    if sys.version_info[:2] < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Check("python", FAIL, detail, f"install Python {need} or newer", EXIT_FAILURE)
    return Check("python", OK, detail)


def nvidia_visible() -> str | None:
    """Where an NVIDIA GPU shows up outside torch (its driver), or None."""
    if os.path.exists("/proc/driver/nvidia"):
        return "/proc/driver/nvidia"
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is on PATH"
    return None


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int]
    total_bytes: int
    free_bytes: int | None  # None when it could not be read


def sm_codes(arch_list: list[str]) -> list[int]:
    """['sm_80', 'sm_90a', 'sm_120', 'compute_120'] -> [80, 90, 120] (machine code only)."""
    codes = []
    for arch in arch_list:
        digits = arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz") if arch.startswith("sm_") else ""
        if digits.isdigit():
            codes.append(int(digits))
    return codes


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build with `arch_list` (torch.cuda.get_arch_list()) has kernels for a
    GPU of compute capability (major, minor): some sm_XY with X == major and Y <= minor
    (machine code runs on later GPUs of the same major version only; PTX is not counted, as
    torch's own warning does not count it)."""
    major, minor = capability
    return any(code // 10 == major and code % 10 <= minor for code in sm_codes(arch_list))


def too_small(gpu: Gpu, dtype: str, quantize: str = "none") -> bool:
    return gpu.total_bytes < gpu_memory_needed_gib(dtype, quantize=quantize) * GIB


def gpu_verdict(gpu: Gpu, arch_list: list[str] | None, dtype: str,
                quantize: str = "none") -> Check:
    """One GPU against the torch build's kernels (`arch_list`; None: not checked, as on
    ROCm) and the model's memory need at `dtype` and `quantize`."""
    need = gpu_memory_needed_gib(dtype, quantize=quantize) * GIB
    sm = f"sm_{gpu.capability[0]}{gpu.capability[1]}"
    free = "free unknown" if gpu.free_bytes is None else f"{_gib(gpu.free_bytes)} free"
    weights = "" if quantize == "none" else f" with {quantize} weights"
    detail = (f"{gpu.name} ({sm}), {_gib(gpu.total_bytes)}, {free}; the model at {dtype}"
              f"{weights} needs about {_gib(need)} (counted from the architecture; the CUDA "
              "margin is an estimate, not measured)")
    name = f"gpu{gpu.index}"
    if arch_list is not None and not arch_supported(gpu.capability, arch_list):
        built = " ".join(a for a in arch_list if a.startswith("sm_")) or "none"
        detail = f"{gpu.name} ({sm}) is not supported by this torch build (kernels for: {built})"
        if gpu.capability[0] * 10 + gpu.capability[1] > max(sm_codes(arch_list), default=0):
            return Check(name, FAIL, detail, CUDA_TORCH_FIX, EXIT_DEVICE)
        return Check(name, FAIL, detail, "this torch is too new for this GPU: install an "
                     "older torch build that still has its kernels, or use --device cpu",
                     EXIT_DEVICE)
    if quantize == "fp8" and gpu.capability < (8, 9):
        return Check(name, FAIL, f"{detail}; fp8 needs compute capability 8.9 or newer",
                     "use --quantize int8 on this GPU", EXIT_DEVICE)
    if too_small(gpu, dtype, quantize):
        for other_dtype, other_quantize, words in (
                ("bf16", quantize, "--dtype bf16"), (dtype, "int8", "--quantize int8"),
                ("bf16", "int8", "--dtype bf16 --quantize int8")):
            if (other_dtype, other_quantize) != (dtype, quantize) and not too_small(
                    gpu, other_dtype, other_quantize):
                smaller = gpu_memory_needed_gib(other_dtype, quantize=other_quantize) * GIB
                return Check(name, FAIL, detail, f"use {words} (about {_gib(smaller)}) on "
                             "this GPU", EXIT_DEVICE)
        return Check(name, FAIL, detail,
                     f"reply and talk need a GPU with {_gib(need)}: use --device cpu on this "
                     "machine (slow), or a bigger GPU", EXIT_DEVICE)
    if gpu.free_bytes is not None and gpu.free_bytes < need:
        return Check(name, WARN, detail, "other processes hold its memory: stop them (see "
                     "nvidia-smi) before reply or talk")
    return Check(name, OK, detail)


CPU_ONLY = ("encode and decode run fine on the CPU; reply works but the 7B model runs far "
            "below real time; talk cannot keep up")


def check_torch_and_gpus(dtype: str = "bf16", quantize: str = "none") -> list[Check]:
    """torch's version and CUDA build; each CUDA GPU against the build and the memory need."""
    import warnings

    need = _gib(gpu_memory_needed_gib(dtype, quantize=quantize) * GIB)
    weights = "" if quantize == "none" else f" with {quantize} weights"
    no_gpu_fix = (f"for reply and talk use an NVIDIA GPU with at least {need} free at {dtype}"
                  f"{weights} (counted from the architecture; the CUDA margin is an estimate, "
                  "not measured)")
    try:
        import torch
    except ImportError as error:
        return [Check("torch", FAIL, f"torch cannot be imported ({error})",
                      "pip install torch (see https://pytorch.org/get-started/locally/)",
                      EXIT_DEVICE),
                Check("gpu", WARN, "no GPU check without torch", no_gpu_fix)]
    version = torch.__version__
    cuda = torch.version.cuda
    rocm = getattr(torch.version, "hip", None)
    driver = nvidia_visible()
    with warnings.catch_warnings():  # torch's own GPU warnings: the checks below say it
        warnings.simplefilter("ignore")
        try:
            available = bool(torch.cuda.is_available())
            count = torch.cuda.device_count() if available else 0
        except Exception as error:  # a broken driver raises from inside torch
            available, count = False, 0
            driver = driver or f"torch.cuda ({type(error).__name__}: {error})"
        checks = []
        if rocm:
            checks.append(Check("torch", OK, f"{version} (ROCm {rocm} build)"))
        elif cuda is None:
            detail = f"{version} (CPU build)"
            if driver:
                checks.append(Check(
                    "torch", WARN, f"{detail}, but an NVIDIA GPU is visible ({driver})",
                    "install the CUDA build of torch, e.g. pip install torch "
                    "--index-url https://download.pytorch.org/whl/cu128"))
            else:
                checks.append(Check("torch", OK, detail))
        else:
            arch = " ".join(torch.cuda.get_arch_list())
            detail = f"{version} (CUDA {cuda} build; {arch or 'no kernels listed'})"
            if not available and driver:
                checks.append(Check(
                    "torch", WARN, f"{detail}, but CUDA is not usable though an NVIDIA GPU is "
                    f"visible ({driver})", f"install an NVIDIA driver that supports CUDA {cuda} "
                    "(nvidia-smi shows the driver's CUDA version), or a torch build for yours"))
            else:
                checks.append(Check("torch", OK, detail))
        if count == 0:
            checks.append(Check("gpu", WARN, f"no CUDA GPU{' usable by torch' if driver else ''}"
                                f": {CPU_ONLY}", no_gpu_fix))
            return checks
        arch_list = None if rocm else list(torch.cuda.get_arch_list())
        gpus = []
        for index in range(count):
            try:
                props = torch.cuda.get_device_properties(index)
                gpu_name, capability = props.name, (props.major, props.minor)
                total = int(props.total_memory)
            except Exception as error:
                checks.append(Check(f"gpu{index}", FAIL, f"cannot query GPU {index} "
                                    f"({type(error).__name__}: {error})",
                                    "check the driver with nvidia-smi", EXIT_DEVICE))
                continue
            try:
                free: int | None = int(torch.cuda.mem_get_info(index)[0])
            except Exception:
                free = None
            gpus.append(Gpu(index, gpu_name, capability, total, free))
    verdicts = [gpu_verdict(gpu, arch_list, dtype, quantize) for gpu in gpus]
    fits = [gpu.index for gpu, v in zip(gpus, verdicts) if v.status == OK]
    for gpu, verdict in zip(gpus, verdicts):
        if fits and verdict.status == FAIL and too_small(gpu, dtype, quantize) and (
                arch_list is None or arch_supported(gpu.capability, arch_list)):
            # Another GPU can run the model: say which, rather than fail.
            verdict = Check(verdict.name, WARN, verdict.detail,
                            f"too small for reply and talk: use --device cuda:{fits[0]}")
        checks.append(verdict)
    return checks


# -- the model ------------------------------------------------------------------------------------

def safetensors_header(path: Path) -> tuple[int, str | None]:
    """(tensor count, problem) from a .safetensors file's header, read without torch by
    model/tensorfile.py, which also catches a truncated file (its last tensor must end
    exactly at the end of the file)."""
    from .model.tensorfile import TensorFileError, read_header

    try:
        return len(read_header(path)), None
    except TensorFileError as error:
        return 0, str(error)


def _count_voices(folder: Path) -> int:
    try:
        return sum(1 for p in folder.glob("*.pt") if p.is_file())
    except OSError:
        return 0


@dataclass
class ModelState:
    """What the model check found; the token and disk checks build on it."""
    kind: str  # "hub" (a repo id, from the hub cache), "folder", or "invalid" (neither)
    complete: bool
    missing_bytes: int = 0  # still to download (hub only; estimates)
    repo: str = DEFAULT_MODEL  # the repo id (hub only)


def _describe_file(path: Path, label: str) -> tuple[str, str | None]:
    """'name 1.2 GB (475 tensors)' and a problem, if any (safetensors files are checked)."""
    size = path.stat().st_size
    text = f"{label} {_size(size)}"
    if path.name.endswith(".safetensors"):
        count, problem = safetensors_header(path)
        if problem:
            return text, f"{label} is {problem}"
        text += f" ({count} tensors)"
    return text, None


def _voices_text(folder: Path) -> tuple[str, bool]:
    """How the voices stand in a model folder, as ModelDir.voices_dir finds them, without
    unpacking anything -> (text, any voice there)."""
    from .model.files import unpacked_voices_dir
    from .model.voices_archive import is_extracted

    def counted(where: Path) -> tuple[str, int]:
        n = _count_voices(where)
        return f"{n} voice{'s' if n != 1 else ''}", n

    voices = folder / VOICES_DIR
    archive = folder / VOICES_ARCHIVE
    if voices.is_dir():
        text, n = counted(voices)
        return f"{VOICES_DIR}/ {text}", n > 0
    if archive.is_file():
        unpacked = unpacked_voices_dir(archive)
        if not is_extracted(archive, unpacked):
            return f"{VOICES_DIR}/ not unpacked yet (done on first use)", True
        text, n = counted(unpacked)
        return f"{VOICES_DIR}/ {text} (unpacked from {VOICES_ARCHIVE} into {unpacked})", n > 0
    return "", False


def check_model(spec: str | None) -> tuple[Check, ModelState]:
    """The model's four files (hub snapshot or folder), without loading any of them."""
    from .errors import ModelMissingError
    from .model.files import resolve_model

    spec = spec or DEFAULT_MODEL
    local = Path(spec).expanduser()
    if local.is_dir():
        return _check_folder(local, spec)
    is_repo = (spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
               and not local.exists())
    if is_repo:
        return _check_hub(spec)
    try:  # not a folder, not a repo id: let the resolver say why, in its words
        resolve_model(spec)
        message = f"model {spec} cannot be used"
    except ModelMissingError as error:
        message = error.message
    return (Check("model", FAIL, message, "give --model a model folder or a Hugging Face repo "
                  f"id (default {DEFAULT_MODEL})", EXIT_MODEL_MISSING),
            ModelState("invalid", False))


def _run(hint: str) -> str:
    """'run `personaplex download`', first unsetting HF_HUB_OFFLINE when it is set."""
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return f"unset HF_HUB_OFFLINE and run {hint}"
    return f"run {hint}"


def _check_hub(repo: str) -> tuple[Check, ModelState]:
    from .errors import ModelMissingError
    from .model.files import check_repo_id, hub_cache_dir, locate_snapshot

    try:
        check_repo_id(repo)
    except ModelMissingError as error:
        return (Check("model", FAIL, error.message, f"give a repo id such as {DEFAULT_MODEL}",
                      EXIT_MODEL_MISSING), ModelState("invalid", False))
    cache = hub_cache_dir()
    hint = download_hint(repo)
    everything = sum(HUB_FILE_BYTES.values())
    partial = _partial_download_bytes(cache, repo)
    snapshot, missing = locate_snapshot(cache, repo, None, HUB_FILES)
    if snapshot is None:
        need = max(0, everything - partial)
        return (Check("model", FAIL, f"{repo} is not in the Hugging Face cache ({cache})",
                      f"{_run(hint)} to fetch it ({_size(need)}), "
                      f"or pass --model DIR ({MIMI_ONLY})", EXIT_MODEL_MISSING),
                ModelState("hub", False, need, repo))
    parts, problems = [], []
    for name in HUB_FILES:
        path = snapshot / name
        if name in missing:
            continue
        text, problem = _describe_file(path, name)
        if problem:
            problems.append((problem, path))
        parts.append(text)
    voices, _ = _voices_text(snapshot)
    if voices:
        parts.append(voices)
    where = f"{repo} (snapshot {snapshot.name[:12]} in {cache})"
    need = 0
    if missing:
        need = max(0, sum(HUB_FILE_BYTES.get(n, 0) for n in missing) - partial)
    detail = f"{where}: {', '.join(parts) or 'no model files'}"
    if missing:
        return (Check("model", FAIL, f"{detail}; missing {', '.join(missing)}",
                      f"{_run(hint)} to fetch {', '.join(missing)} "
                      f"({_size(need)})", EXIT_MODEL_MISSING),
                ModelState("hub", False, need, repo))
    if problems:
        problem, path = problems[0]
        return (Check("model", FAIL, f"{detail}; {problem}",
                      f"remove it (rm \"$(readlink -f {path})\" {path}) and run {hint} again",
                      EXIT_MODEL_INVALID), ModelState("hub", False, 0, repo))
    return Check("model", OK, f"{detail}; complete"), ModelState("hub", True, 0, repo)


def _partial_download_bytes(cache: Path, repo: str) -> int:
    """Bytes of interrupted downloads (blobs/*.incomplete) the next download continues."""
    from .model.files import repo_folder

    try:
        return sum(p.stat().st_size for p in (repo_folder(cache, repo) / "blobs").glob(
            "*.incomplete") if p.is_file())
    except OSError:
        return 0


def _check_folder(folder: Path, spec: str) -> tuple[Check, ModelState]:
    from .errors import ModelMissingError
    from .model.files import AmbiguousModelFileError, ModelDir

    model = ModelDir(folder, spec)
    parts, missing, problems = [], [], []
    mimi_ok = False
    for what, pick, wanted in (("Mimi", model.mimi_file, MIMI_FILE),
                               ("LM", model.lm_file, LM_FILE),
                               ("text tokenizer", model.tokenizer_file, TOKENIZER_FILE)):
        try:
            path = pick()
        except AmbiguousModelFileError as error:
            problems.append(error.message)
            continue
        except ModelMissingError:
            missing.append(wanted)
            continue
        text, problem = _describe_file(path, path.name)
        if problem:
            problems.append(problem)
        elif what == "Mimi":
            mimi_ok = True
        parts.append(text)
    voices, has_voices = _voices_text(folder)
    no_voices = [] if has_voices else [f"{VOICES_DIR}/ or {VOICES_ARCHIVE}"]
    if voices:
        parts.append(voices)
    arch = model.arch_file()
    if arch:
        parts.append(f"{arch.name} (architecture overrides)")
    detail = f"folder {folder}: {', '.join(parts) or 'no model files'}"
    if problems:
        return (Check("model", FAIL, f"{detail}; {problems[0]}",
                      "replace the file with a complete copy (or use the hub model: "
                      f"{download_hint()})", EXIT_MODEL_INVALID), ModelState("folder", False, 0))
    if missing:
        missing += no_voices
        works = ("; encode and decode will work (they need only Mimi); reply, talk and "
                 "voices create will not" if mimi_ok else "")
        return (Check("model", FAIL, f"{detail}; missing {', '.join(missing)}{works}",
                      f"put {', '.join(missing)} into {folder}, or use the hub model: "
                      f"{download_hint()}", EXIT_MODEL_MISSING), ModelState("folder", False, 0))
    if no_voices:
        # Everything runs but a packaged voice by name: a warning, as for absent hardware.
        from .prompts.voices import DEFAULT_VOICE, WITHOUT_PACKAGED

        return (Check("model", WARN, f"{detail}; no packaged voices ({no_voices[0]}): "
                      "encode, decode and voices create work, and reply and talk with "
                      f"--voice FILE or --voice ''; a packaged voice by name (the default "
                      f"{DEFAULT_VOICE} among them) does not",
                      f"{model.voices_hint()}; {WITHOUT_PACKAGED}"),
                ModelState("folder", True, 0))
    return Check("model", OK, f"{detail}; complete"), ModelState("folder", True, 0)


# -- the Hugging Face token and the disk -----------------------------------------------------

def token_file() -> tuple[Path, str]:
    """The file `hf auth login` writes, and which setting named it."""
    configured = os.environ.get("HF_TOKEN_PATH")
    if configured:
        return Path(os.path.expandvars(os.path.expanduser(configured))), "HF_TOKEN_PATH"
    return hf_home() / "token", "HF_HOME" if os.environ.get("HF_HOME") else "default"


def find_token() -> str | None:
    """Where a Hugging Face token is (never the token itself), or None.

    huggingface_hub's order: HF_TOKEN (or the older HUGGING_FACE_HUB_TOKEN), then the token
    file; blank values do not count."""
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(variable, "").strip():
            return f"the {variable} environment variable"
    path, source = token_file()
    try:
        if path.read_text(errors="replace").strip():
            return f"the token file {path}" + (f" (from {source})" if source != "default" else "")
    except OSError:
        pass
    return None


def check_token(model: ModelState) -> Check:
    where = find_token()
    if where:
        return Check("hf-token", OK, f"a Hugging Face token is set, in {where}")
    path, _ = token_file()
    detail = f"no Hugging Face token (HF_TOKEN is unset, no token file at {path})"
    if model.kind == "folder":
        return Check("hf-token", OK, f"{detail}; not needed for a model folder")
    if model.complete:
        return Check("hf-token", OK, f"{detail}; not needed: the model is downloaded")
    return Check("hf-token", WARN, f"{detail}; the model is gated, so download needs one",
                 f"accept the licence at {licence_url(model.repo)}, then run `hf auth login` "
                 "or set HF_TOKEN")


def check_disk(model: ModelState) -> Check:
    from .model.files import hub_cache_dir

    cache = hub_cache_dir()
    where = existing_parent(cache)
    try:
        free = shutil.disk_usage(where).free
    except OSError as error:
        return Check("disk", WARN, f"cannot read the free space at {where} ({error.strerror})",
                     "check that the hub cache folder is readable")
    detail = f"{_size(free)} free at {where} (the Hugging Face cache"
    detail += ")" if where == cache else f" {cache} will be made there)"
    if model.kind == "folder":
        return Check("disk", OK, f"{detail}; nothing to download (--model is a folder)")
    if model.kind == "invalid":
        return Check("disk", OK, detail)
    if model.missing_bytes == 0:
        return Check("disk", OK, f"{detail}; nothing left to download")
    detail += f"; the download still needs {_size(model.missing_bytes)}"
    if free < model.missing_bytes:
        return Check("disk", FAIL, detail,
                     f"free {_size(model.missing_bytes - free)} there, or point HF_HUB_CACHE "
                     "(or HF_HOME) at a disk with room", EXIT_OUTPUT)
    return Check("disk", OK, detail)


# -- live audio (talk) -------------------------------------------------------------------------

def check_audio() -> list[Check]:
    """PortAudio, then the default input and output devices (through live/devices.py)."""
    from .live.devices import (choose_samplerate, import_sounddevice, list_devices,
                                resolve_device)
    from .live.errors import AudioDeviceError

    try:
        sd = import_sounddevice()
    except AudioDeviceError as error:
        return [Check("portaudio", FAIL, error.message.split(";")[0],
                      "install PortAudio, e.g. apt install libportaudio2 (talk needs it)"
                      if "PortAudio" in error.message else
                      "pip install sounddevice (talk needs it)", EXIT_AUDIO_DEVICE),
                Check("audio-devices", WARN, "not checked without PortAudio",
                      "install PortAudio first")]
    portaudio = str(sd.get_portaudio_version()[1]).split(",")[0]  # less the git revision
    checks = [Check("portaudio", OK, f"{portaudio} (sounddevice {sd.__version__})")]
    no_device_fix = ("talk needs a microphone and a speaker: connect them, or start a sound "
                     "server (PipeWire, PulseAudio); the file commands need neither")
    try:
        devices = {d.index: d for d in list_devices(sd)}
    except Exception as error:  # PortAudio errors while querying
        checks.append(Check("audio-devices", WARN, f"cannot list the audio devices ({error})",
                            no_device_fix))
        return checks
    if not devices:
        checks.append(Check("audio-devices", WARN, "no audio devices found", no_device_fix))
        return checks
    found, problems = [], []
    ends = {}
    for kind in ("input", "output"):
        try:
            index = resolve_device(None, kind, sd)
        except AudioDeviceError as error:
            problems.append(error.message)
            continue
        ends[kind] = index
        d = devices[index]
        found.append(f"{kind} #{index} {d.name} ({d.hostapi}, {d.default_samplerate:.0f} Hz)")
    detail = "; ".join(found + problems)
    if problems:
        checks.append(Check("audio-devices", WARN, detail, no_device_fix))
        return checks
    try:
        rate = choose_samplerate(ends["input"], ends["output"], sd=sd)
        detail += ("; 24 kHz directly" if rate == SAMPLE_RATE
                   else f"; runs at {rate} Hz (resampled to 24 kHz)")
    except AudioDeviceError as error:
        checks.append(Check("audio-devices", WARN, f"{detail}; {error.message}",
                            "choose other devices with --input-device/--output-device"))
        return checks
    checks.append(Check("audio-devices", OK, detail))
    return checks


def check_echo_canceller() -> Check:
    """The library live/echo.py cancels echo with (pywebrtc-audio), by making one canceller."""
    from .live.errors import EchoCancellerMissing

    try:
        from .live.echo import EchoCanceller

        EchoCanceller(SAMPLE_RATE)
    except EchoCancellerMissing:
        return Check("echo-cancel", WARN, "pywebrtc-audio is not installed: talk cannot "
                     "cancel the speaker's echo",
                     "pip install pywebrtc-audio, or use headphones with talk --no-echo-cancel")
    except Exception as error:
        return Check("echo-cancel", WARN, f"pywebrtc-audio does not work here "
                     f"({type(error).__name__}: {error})",
                     "reinstall it (pip install --force-reinstall pywebrtc-audio), or use "
                     "headphones with talk --no-echo-cancel")
    try:
        from importlib.metadata import version

        text = f"pywebrtc-audio {version('pywebrtc-audio')}"
    except Exception:
        text = "pywebrtc-audio"
    return Check("echo-cancel", OK, f"{text} (WebRTC AEC3, for talk on speakers)")


SERVE_PACKAGES = ("sphn", "starlette", "uvicorn", "websockets")
SERVE_PORT = 8998  # serve's default (cli/serve.py says so too: NVIDIA's port)


def check_serve() -> Check:
    """What `serve` needs beyond the model: its web stack and Opus, and its default port."""
    import socket
    from importlib.metadata import PackageNotFoundError, version

    found, missing = [], []
    for name in SERVE_PACKAGES:
        try:
            __import__(name)
            found.append(f"{name} {version(name)}")
        except (ImportError, PackageNotFoundError):
            missing.append(name)
    if missing:
        return Check("serve", WARN, f"{', '.join(missing)} not installed: serve cannot run",
                     f"pip install {' '.join(missing)}")
    import sphn

    if hasattr(sphn.OpusStreamWriter, "read_bytes"):  # 0.1's API: append, then poll
        return Check("serve", WARN, f"sphn {version('sphn')} is too old: serve needs 0.2",
                     "pip install 'sphn>=0.2,<0.3'")
    detail = ", ".join(found)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", SERVE_PORT))
        except OSError:
            return Check("serve", WARN, f"{detail}; port {SERVE_PORT} is in use",
                         "stop what listens there, or serve --port N")
    return Check("serve", OK, f"{detail}; port {SERVE_PORT} free")


# -- everything ------------------------------------------------------------------------------

def run_checks(model: str | None = None, dtype: str = "bf16", timer=None,
               quantize: str = "none") -> list[Check]:
    """Every check, in the order reported. `timer(name, seconds)` hears how long each took.

    A check that raises (a bug, or a library failing in a way not foreseen) becomes a
    failed check of its own, so the others are still reported."""
    import time
    import traceback

    def timed(name, function, *args, fallback=None):
        start = time.perf_counter()
        try:
            value = function(*args)
        except Exception as error:  # noqa: BLE001 - reported as a check, never a traceback
            failed = Check(name, FAIL, f"the check itself failed: {type(error).__name__}: "
                           f"{error}", "please report it (-vv shows the traceback)",
                           EXIT_FAILURE)
            if timer is not None:
                timer(name, time.perf_counter() - start,
                      "".join(traceback.format_exception(error)))
            return fallback(failed) if fallback else failed
        if timer is not None:
            timer(name, time.perf_counter() - start, None)
        return value

    results: list[Check] = [timed("python", check_python)]
    results.extend(timed("torch", check_torch_and_gpus, dtype, quantize,
                         fallback=lambda c: [c]))
    model_check, state = timed("model", check_model, model,
                               fallback=lambda c: (c, ModelState("invalid", False)))
    results.append(model_check)
    results.append(timed("hf-token", check_token, state))
    results.append(timed("disk", check_disk, state))
    results.extend(timed("portaudio", check_audio, fallback=lambda c: [c]))
    results.append(timed("echo-cancel", check_echo_canceller))
    results.append(timed("serve", check_serve))
    return results
