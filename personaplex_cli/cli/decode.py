"""`personaplex decode`: Mimi codes (.mimi or .npy) -> audio."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Callable, Iterator

import typer

from ..core.config import CODEC_WINDOW, SAMPLE_RATE
from ..outputs import STDIO, check_input, open_output, reads_model, with_suffix
from .options import (DEFAULT_MODEL, DeviceOpt, ForceOpt, ModelOpt, QuietOpt, RateOpt,
                      SampleFormatOpt, VerboseOpt, audio_format, check_rate, samples_as)
from .output import Output


class AudioFormat(str, Enum):
    wav = "wav"
    flac = "flac"
    ogg = "ogg"
    opus = "opus"
    raw = "raw"


def output_format(requested: AudioFormat | None, raw: bool, target: str | None) -> str:
    """The audio format from --format/--raw and the output's suffix; contradictions refused."""
    asked = "raw" if raw else (requested.value if requested else None)
    if raw and requested not in (None, AudioFormat.raw):
        raise typer.BadParameter(f"--raw contradicts --format {requested.value}",
                                 param_hint="'--raw'")
    if target is None:  # the default name, IN.decoded.<format>
        return asked or "wav"
    return audio_format(target, "--output", asked)


class Window(str, Enum):
    kyutai = "kyutai"
    nvidia = "nvidia"


@dataclass
class _Codes:
    """An opened code file: its chunks [K, n] and what it says about them."""

    chunks: Iterator
    num_samples: int | None = None
    final_num_samples: Callable[[], int | None] | None = None  # a trailer's, at the end
    made_with: str | None = None  # the Mimi weights' sha256
    window: str | None = None  # the attention window rule they were made under (None: the
    # file records none, a .npy)


def _open_codes(path: str) -> _Codes:
    from ..codec import CHUNK_FRAMES
    from ..codes import CodeFileError, CodeReader, load_npy, sniff_format

    name = "stdin" if path == STDIO else path
    stream = sys.stdin.buffer if path == STDIO else open(path, "rb")
    head = stream.read(8)
    kind = sniff_format(head)
    if kind == "mimi":
        reader = CodeReader(stream, prefix=head, name=name)
        header = reader.header
        codes = _Codes(reader.frames(max_frames=CHUNK_FRAMES), header.num_samples,
                       made_with=header.weights_sha256, window=header.window)
        if header.num_samples is None and reader.has_trailer:
            # Encoded from a stream of unknown length: the count comes at its end.
            codes.final_num_samples = lambda: reader.num_samples
        elif header.num_samples is None and reader.num_frames is not None:
            codes.num_samples = reader.num_frames * header.frame_size
        return codes
    if kind == "npy":
        return _Codes(iter([load_npy(stream, prefix=head, name=name)]))
    if not head:
        raise CodeFileError(f"{name}: empty input")
    raise CodeFileError(f"{name}: not a .mimi or .npy code file")


def decode(
    input: Annotated[str, typer.Argument(metavar="IN", help="Code file (.mimi/.npy), or -.")],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", metavar="OUT",
        help="Audio file, or - for stdout (default: IN with .decoded.wav; stdout when IN "
        "is -).")] = None,
    format: Annotated[AudioFormat | None, typer.Option(
        "--format", help="Audio format (default: from OUT's suffix, else wav).")] = None,
    sample_format: SampleFormatOpt = None,
    raw: Annotated[bool, typer.Option(
        "--raw", help="Headerless little-endian PCM (same as --format raw).")] = False,
    rate: RateOpt = SAMPLE_RATE,
    ignore_weights: Annotated[bool, typer.Option(
        "--ignore-weights", help="Decode even if the codes came from other Mimi weights.")
    ] = False,
    window: Annotated[Window | None, typer.Option(
        "--window", help="Mimi's attention window rule (default: the one the .mimi file "
        "records, nvidia for reply's codes; kyutai for encode's, .npy and older files).")
    ] = None,
    model: ModelOpt = DEFAULT_MODEL,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Decode Mimi codes to audio: WAV, FLAC, Ogg (Vorbis or Opus) or raw PCM.

    The output is trimmed to the original length when the code file records it. A WAV gets
    an exact header from its first byte when that length is known up front, also on a pipe.
    """
    out = Output(quiet, verbose)
    check_input(input)
    fmt = output_format(format, raw, output)
    sample_as = samples_as(fmt, sample_format)
    check_rate(fmt, rate)
    # `x.mimi` -> `x.decoded.wav`: never the recording the codes were made from.
    target = output or with_suffix(input, f".decoded.{fmt}")
    reads_model(model)
    with open_output(target, force=force, inputs=(input,)) as sink:
        from ..audio.frames import OutputPcm
        from ..audio.writers import open_writer
        from ..codec import decode_stream
        from ..errors import InputError
        from ..model.model import Model

        codes = _open_codes(input)
        the_model = Model.open(model, device)
        out.info(f"model: {the_model.path}")
        out.info(f"device: {the_model.device}")
        mimi = the_model.mimi
        made_with = codes.made_with
        if made_with and made_with != the_model.mimi_sha256 and not ignore_weights:
            raise InputError("these codes were made with other Mimi weights "
                             f"(sha256 {made_with[:12]}..., ours "
                             f"{the_model.mimi_sha256[:12]}...); "
                             "pass --ignore-weights to decode anyway")
        rule = window.value if window is not None else codes.window or CODEC_WINDOW
        if window is None and codes.window is None:
            # reply's codes decode to its answer only under NVIDIA's rule: said, not guessed.
            out.warn(f"{input} records no attention window (a .npy): decoding with "
                     f"{CODEC_WINDOW}'s, as encode's codes want; codes from reply want "
                     "--window nvidia")
        out.info(f"output: {fmt}, {rate} Hz; {rule}'s attention window")
        num_samples = codes.num_samples
        length = None if num_samples is None else OutputPcm.length(num_samples, rate)
        with open_writer(sink, fmt, rate, 1, sample_as, num_frames=length) as writer:
            pcm_out = OutputPcm(writer.write, rate)
            n = decode_stream(mimi, codes.chunks, pcm_out.write, num_samples=num_samples,
                              final_num_samples=codes.final_num_samples, window=rule)
            pcm_out.close()
        out.debug(f"{n} samples at 24 kHz decoded")
