"""Options shared by the commands, declared once as `Annotated` types.

Imports only typer and the standard library: `--help` and shell completion load this.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Annotated

import typer

from ..core.config import COMPILE_MODES, DEFAULT_COMPILE, DTYPE_NAMES, MAX_SEED, QUANTIZE_MODES
from ..model.files import DEFAULT_MODEL  # noqa: F401  (re-exported for the commands' defaults)
from ..runtime.limits import MAX_PRIME_S, OFFLINE_MAX_PRIME_S  # noqa: F401  (the defaults)

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _check_device(value: str) -> str:
    if not _DEVICE_RE.match(value):
        raise typer.BadParameter("expected auto, cpu, cuda or cuda:N")
    return value


def number_in(low: float | None = None, high: float | None = None):
    """The check of every float option: NaN, the infinities and values outside [low, high]
    are refused, each for its own reason (Typer's range check lets inf through and calls
    nan "not >= 0")."""

    def check(value: float | None) -> float | None:
        if value is None:
            return value
        if math.isnan(value):
            raise typer.BadParameter(f"{value} is not a number")
        if math.isinf(value):
            raise typer.BadParameter(f"must be a finite number, not {value}")
        if low is not None and value < low:
            raise typer.BadParameter(f"must be at least {low:g}, not {value:g}")
        if high is not None and value > high:
            raise typer.BadParameter(f"must be at most {high:g}, not {value:g}")
        return value

    return check


ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", envvar="PERSONAPLEX_MODEL", metavar="REPO|DIR",
    help="Hugging Face repo id (from the local cache) or a model directory.")]
DeviceOpt = Annotated[str, typer.Option(
    "--device", envvar="PERSONAPLEX_DEVICE", metavar="auto|cpu|cuda[:N]",
    callback=_check_device, autocompletion=lambda: ["auto", "cpu", "cuda"],
    help="Compute device; auto picks CUDA when available.")]
ForceOpt = Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print errors only.")]
VerboseOpt = Annotated[int, typer.Option(
    "--verbose", "-v", count=True,
    help="-v: say what is being done; -vv: also details and tracebacks for bug reports.")]


# -- the persona, sampling and precision: shared by reply and talk ---------------------------

Dtype = Enum("Dtype", {name: name for name in DTYPE_NAMES}, type=str)


def voice_names(ctx: typer.Context, incomplete: str) -> list[str]:
    """Voice names for shell completion (`--voice`, `voices show`): the user's own and those
    of the model the command line names so far (--model, else PERSONAPLEX_MODEL), no torch."""
    from ..model.files import PACKAGED
    from ..prompts.voices import catalog

    try:
        from ..model.files import resolve_model

        folder = resolve_model(ctx.params.get("model")).voices_dir()
    except Exception:  # completion must never fail loudly
        folder = None
    names = set(PACKAGED) | set(catalog(folder))
    return sorted(name for name in names if name.startswith(incomplete))


def _check_voice(value: str) -> str:
    if value == "-":
        raise typer.BadParameter("a voice is read from a file, never from stdin: name a "
                                 "voice, a .pt or a .wav file")
    return value


VoiceOpt = Annotated[str, typer.Option(
    "--voice", metavar="NAME|FILE", autocompletion=voice_names, callback=_check_voice,
    help="A voice name (see `personaplex voices list`; NATF2.pt names NATF2 when no such "
    "file is here), a .pt voice or a .wav recording; '' for none.")]
PromptOpt = Annotated[str | None, typer.Option(
    "--prompt", "-p", metavar="TEXT",
    help="The role prompt (default: NVIDIA's teacher prompt).")]
PromptFileOpt = Annotated[str | None, typer.Option(
    "--prompt-file", metavar="FILE", help="Read the role prompt from FILE (- for stdin).")]
TemperatureOpt = Annotated[float, typer.Option(
    "--temperature", callback=number_in(0), help="Sampling temperature of the text stream "
    "(0 or more).")]
TopKOpt = Annotated[int, typer.Option(
    "--top-k", min=0, metavar="K", help="Sample the text from the k most likely tokens (0: all).")]
AudioTemperatureOpt = Annotated[float, typer.Option(
    "--audio-temperature", callback=number_in(0), help="Sampling temperature of the audio "
    "codes (0 or more).")]
AudioTopKOpt = Annotated[int, typer.Option(
    "--audio-top-k", min=0, metavar="K",
    help="Sample audio codes from the k most likely (0: all).")]
MaxPrimeOpt = Annotated[float, typer.Option(
    "--max-prime-s", metavar="SECONDS", callback=number_in(0),
    help="Refuse a role prompt that takes longer than this to prime on the device (the "
    "cost per token measured here; 0: no limit).")]
GreedyOpt = Annotated[bool, typer.Option(
    "--greedy", help="Always take the most likely token (no sampling; deterministic).")]
def _check_seed(value: int | None) -> int | None:
    # A callback, not min/max: Typer widens the help's metavar column by the range it
    # would print, and at 80 columns the default model's name was cut.
    if value is not None and not 0 <= value <= MAX_SEED:
        raise typer.BadParameter(f"{value} is not a seed: a seed is 0 to {MAX_SEED}")
    return value


SeedOpt = Annotated[int | None, typer.Option(
    "--seed", metavar="N", callback=_check_seed,
    help="Seed the sampling, so a run repeats exactly.")]
Quantize = Enum("Quantize", {mode: mode for mode in QUANTIZE_MODES}, type=str)


DtypeOpt = Annotated[Dtype | None, typer.Option(
    "--dtype", help="Precision of the language model (default: bf16 on CUDA and on CPUs "
    "with native bf16, else fp32).")]
QuantizeOpt = Annotated[Quantize, typer.Option(
    "--quantize", metavar="KIND",
    help="none, or store the language model's transformer weights quantized at load: int8 "
    "(about half the memory of bf16; on x86 CPUs each activation row is quantized too, for "
    "a faster int8 x int8 kernel, built here where the CPU has AVX-512 VNNI), int8-weights (the same bytes, activations left alone: "
    "closer to the unquantized model, slower on the CPU), int4 (about a third; CPUs "
    "and GPUs of compute capability 8.0+) or fp8 (GPUs of compute capability 8.9+).")]


Compile = Enum("Compile", {mode: mode for mode in COMPILE_MODES}, type=str)
COMPILE_DEFAULT = Compile(DEFAULT_COMPILE)
CompileOpt = Annotated[Compile, typer.Option(
    "--compile", envvar="PERSONAPLEX_COMPILE",
    help="Compile the LM's step with torch.compile (inductor's C++ backend) on the CPU: "
    "off (the default: the first run compiles for up to five minutes on 2 cores), auto "
    "for quantized models where a C++ compiler is found and its cache can be written "
    "(later runs load the compiled step in seconds), on for any CPU model (exit 5 without "
    "a compiler, or with a torch that cannot save compiled functions).")]


Graphs = Enum("Graphs", {mode: mode for mode in ("auto", "on", "off")}, type=str)
GraphsOpt = Annotated[Graphs, typer.Option(
    "--graphs", help="Replay each frame's work as CUDA graphs: auto (on CUDA; where a "
    "capture fails, one warning and eager steps), on (a failed capture stops the run) or "
    "off.")]


def graphs_choice(value) -> bool | None:
    """--graphs as the engine takes it: None (auto), True (on) or False (off)."""
    return {"auto": None, "on": True, "off": False}[getattr(value, "value", value)]


def _check_ray_address(value: str | None) -> str | None:
    if value is not None and (not value or value.startswith("-")):
        raise typer.BadParameter(f"{value!r} is no cluster: give local, auto or HOST:PORT")
    return value


RayOpt = Annotated[str | None, typer.Option(
    "--ray", metavar="ADDRESS", callback=_check_ray_address,
    help="Run on a Ray cluster: local (one started on this machine for the run), auto (the "
    "cluster this machine is in, or $RAY_ADDRESS, as ray job submit sets it) or HOST:PORT. "
    "Needs the ray extra.")]
Bf16DtypeOpt = Annotated[Dtype | None, typer.Option(
    "--dtype", help="Precision of the language model (default: bf16, the released model's, "
    "whatever the device).")]


def role_text(prompt: str | None, prompt_file: str | None) -> str:
    """The role prompt from --prompt or --prompt-file, or the default; one that is not
    UTF-8 text (a shell's Latin-1 bytes) is refused here, before the model loads."""
    from ..errors import InputError
    from ..model.tokenizer import DEFAULT_ROLE, not_utf8

    if prompt is not None and prompt_file is not None:
        raise typer.BadParameter("give --prompt or --prompt-file, not both",
                                 param_hint="'--prompt-file'")
    if prompt_file is not None:
        import sys

        try:
            if prompt_file == "-":
                return sys.stdin.read()
            with open(prompt_file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise InputError(f"cannot read the prompt file {prompt_file}: {reason}") from None
    if prompt is not None and not_utf8(prompt, "--prompt") is not None:
        raise InputError(not_utf8(prompt, "--prompt"))
    return DEFAULT_ROLE if prompt is None else prompt


def sampling(temperature: float, top_k: int, audio_temperature: float, audio_top_k: int,
             greedy: bool):
    from ..core.sampling import Sampling

    return Sampling(temp_text=temperature, top_k_text=top_k, temp_audio=audio_temperature,
                    top_k_audio=audio_top_k, greedy=greedy)


# -- audio outputs: shared by decode, reply and talk ----------------------------------------

class SampleFormat(str, Enum):
    s16 = "s16"
    f32 = "f32"


RateOpt = Annotated[int, typer.Option(
    "--rate", "-r", min=1000, max=384000, metavar="HZ", help="Output sample rate in Hz.")]
SampleFormatOpt = Annotated[SampleFormat | None, typer.Option(
    "--sample-format", help="WAV/raw samples: s16 (default) or f32, the decoder's exact "
    "float values, unclipped.")]


def agreed_format(target: str, by_suffix: str | None, asked: str | None) -> str | None:
    """--format and the output's suffix: either alone decides; both must agree."""
    if asked and by_suffix and asked != by_suffix:
        raise typer.BadParameter(f"{target} names {by_suffix} but {asked} was asked for; "
                                 "change the suffix or the format", param_hint="'--format'")
    return asked or by_suffix


def audio_format(target: str, option: str, asked: str | None = None) -> str:
    """The format of an audio output: its suffix's (one we cannot write is refused, never
    written as WAV), or `asked` (--format, which the suffix must not contradict); WAV for
    `-` and a name without a suffix."""
    from ..audio.writers import format_of, unwritable_suffix, written_suffixes

    suffix = unwritable_suffix(target)
    if suffix and asked is None:
        raise typer.BadParameter(f"cannot write {target}: personaplex does not write {suffix} "
                                 f"files; name it {written_suffixes()} (no suffix: WAV)",
                                 param_hint=f"'{option}'")
    return agreed_format(target, format_of(target), asked) or "wav"


def samples_as(fmt: str, sample_format: SampleFormat | None) -> str:
    """The sample format for an output of format `fmt`; one it cannot store is refused."""
    from ..audio.writers import SAMPLE_FORMATS

    if sample_format is None:
        return "s16"
    if sample_format.value not in SAMPLE_FORMATS[fmt]:
        raise typer.BadParameter(f"{fmt} output does not take --sample-format "
                                 f"{sample_format.value}", param_hint="'--sample-format'")
    return sample_format.value


def check_rate(fmt: str, rate: int) -> None:
    """Refuses a --rate that an output of format `fmt` cannot store (before anything runs)."""
    from ..audio.writers import rate_problem

    problem = rate_problem(fmt, rate)
    if problem:
        raise typer.BadParameter(problem, param_hint="'--rate'")
