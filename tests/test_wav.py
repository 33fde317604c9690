"""Tests for the streaming WAV/raw writers (personaplex_cli.audio.wav)."""

import io
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from personaplex_cli.audio.wav import RawWriter, WavWriter

REPO = Path(__file__).resolve().parents[1]
UNKNOWN = 0xFFFFFFFF


class PipeLike(io.BytesIO):
    """An in-memory stream that, like a pipe, cannot seek."""

    def seekable(self):
        return False

    def tell(self):
        raise OSError("Illegal seek")

    def seek(self, *args):
        raise OSError("Illegal seek")


def _signal(n, channels=1, seed=0):
    x = np.random.default_rng(seed).uniform(-1, 1, (n, channels)).astype(np.float32)
    return x[:, 0] if channels == 1 else x


def _sizes(data: bytes, header_size: int):
    """(riff_size, data_size) read from a header written by WavWriter."""
    riff = struct.unpack_from("<I", data, 4)[0]
    assert data[header_size - 8:header_size - 4] == b"data"
    return riff, struct.unpack_from("<I", data, header_size - 4)[0]


def test_s16_round_trip_exact_header():
    x = _signal(1000)
    x[:3] = [1.0, -1.0, 0.0]
    buf = io.BytesIO()
    with WavWriter(buf, 24000, num_frames=1000) as w:
        w.write(x[:400])
        w.write(x[400:])
    data = buf.getvalue()
    assert len(data) == 44 + 2 * 1000
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert _sizes(data, 44) == (36 + 2000, 2000)
    ints, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == 24000
    np.testing.assert_array_equal(ints, np.round(x * 32767).astype(np.int16))
    assert np.abs(ints / 32767 - x).max() <= 0.5 / 32767 + 1e-7
    assert list(ints[:3]) == [32767, -32767, 0]


def test_s16_clips_and_zeroes_nan():
    buf = io.BytesIO()
    with WavWriter(buf, 16000) as w:
        w.write(np.array([2.0, -3.0, np.nan, 0.5], np.float32))
    ints, _ = sf.read(io.BytesIO(buf.getvalue()), dtype="int16")
    assert list(ints) == [32767, -32767, 0, 16384]  # 16383.5 rounds to even


def test_f32_round_trip_bit_exact_stereo():
    x = _signal(777, channels=2) * 3  # beyond [-1, 1]: f32 must not clip
    buf = io.BytesIO()
    with WavWriter(buf, 48000, channels=2, sample_format="f32", num_frames=777) as w:
        w.write(x)
    data = buf.getvalue()
    assert len(data) == 58 + 777 * 8
    assert _sizes(data, 58) == (50 + 777 * 8, 777 * 8)
    assert struct.unpack_from("<4sII", data, 38) == (b"fact", 4, 777)
    assert sf.info(io.BytesIO(data)).subtype == "FLOAT"
    y, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == 48000
    assert y.tobytes() == x.tobytes()


def test_unknown_length_placeholders_then_patched(tmp_path):
    path = tmp_path / "out.wav"
    x = _signal(500)
    with open(path, "wb") as f:
        w = WavWriter(f, 24000)
        w.write(x)
        assert _sizes(path.read_bytes(), 44) == (UNKNOWN, UNKNOWN)  # flushed, not yet patched
        w.close()
    data = path.read_bytes()
    assert _sizes(data, 44) == (36 + 1000, 1000)
    info = sf.info(str(path))
    assert info.frames == 500


def test_unknown_length_f32_patched_fact():
    buf = io.BytesIO()
    with WavWriter(buf, 24000, sample_format="f32") as w:
        w.write(_signal(10))
    data = buf.getvalue()
    assert _sizes(data, 58) == (50 + 40, 40)
    assert struct.unpack_from("<I", data, 46)[0] == 10


def test_header_at_nonzero_offset_is_patched():
    buf = io.BytesIO()
    buf.write(b"prefix")
    with WavWriter(buf, 24000) as w:
        w.write(_signal(8))
    data = buf.getvalue()[6:]
    assert _sizes(data, 44) == (36 + 16, 16)


def test_non_seekable_keeps_placeholders_and_reads_back():
    x = _signal(300)
    for fmt, hs in (("s16", 44), ("f32", 58)):
        out = PipeLike()
        with WavWriter(out, 24000, sample_format=fmt) as w:
            w.write(x)
        data = out.getvalue()
        assert _sizes(data, hs) == (UNKNOWN, UNKNOWN)
        y, _ = sf.read(io.BytesIO(data), dtype="float32")
        assert len(y) == 300


def test_fewer_frames_than_declared():
    x = _signal(100)
    seekable = io.BytesIO()
    with WavWriter(seekable, 24000, num_frames=250) as w:
        w.write(x)
    assert _sizes(seekable.getvalue(), 44) == (36 + 200, 200)  # patched to the truth

    pipe = PipeLike()
    with WavWriter(pipe, 24000, num_frames=250) as w:
        w.write(x)
    data = pipe.getvalue()
    assert len(data) == 44 + 500 and _sizes(data, 44) == (36 + 500, 500)  # padded
    y, _ = sf.read(io.BytesIO(data), dtype="int16")
    assert not y[100:].any()


def test_a_pipe_far_shorter_than_declared_is_not_padded():
    """Padding stops at PAD_LIMIT_SECONDS: a pipe stream whose header claimed an hour and
    that holds a second ends there (what readers of an unknown length read), instead of
    an hour of zeros on stdout; a second short is still padded."""
    from personaplex_cli.audio.wav import PAD_LIMIT_SECONDS

    limit = int(PAD_LIMIT_SECONDS * 24000)
    pipe = PipeLike()
    with WavWriter(pipe, 24000, num_frames=3600 * 24000) as w:
        w.write(_signal(24000))
    assert len(pipe.getvalue()) == 44 + 2 * 24000
    pipe = PipeLike()
    with WavWriter(pipe, 24000, num_frames=24000 + limit) as w:
        w.write(_signal(24000))
    assert len(pipe.getvalue()) == 44 + 2 * (24000 + limit)


def test_no_padding_when_the_block_raised():
    pipe = PipeLike()
    with pytest.raises(RuntimeError):
        with WavWriter(pipe, 24000, num_frames=10_000) as w:
            w.write(_signal(10))
            raise RuntimeError("model crashed")
    assert len(pipe.getvalue()) == 44 + 20


def test_more_frames_than_declared_raises():
    with WavWriter(io.BytesIO(), 24000, num_frames=5) as w:
        w.write(_signal(3))
        with pytest.raises(ValueError):
            w.write(_signal(3))


def test_bad_arguments():
    with pytest.raises(ValueError):
        WavWriter(io.BytesIO(), 24000, sample_format="s24")
    w = WavWriter(io.BytesIO(), 24000, channels=2)
    with pytest.raises(ValueError):
        w.write(np.zeros(10, np.float32))  # 1-D is mono only
    with pytest.raises(ValueError):
        w.write(np.zeros((10, 3), np.float32))
    w.close()
    with pytest.raises(ValueError):
        w.write(np.zeros((10, 2), np.float32))


def test_raw_writer():
    x = np.array([0.0, 0.5, -1.0, 1.5], np.float32)
    out = PipeLike()
    with RawWriter(out, 24000) as w:
        w.write(x)
    assert np.frombuffer(out.getvalue(), "<i2").tolist() == [0, 16384, -32767, 32767]
    out = PipeLike()
    with RawWriter(out, 24000, sample_format="f32", num_frames=8) as w:
        w.write(x)  # raw streams are never padded
    assert np.frombuffer(out.getvalue(), "<f4").tobytes() == x.tobytes()


def test_streamed_wav_through_a_real_pipe():
    """A child writes to its stdout pipe (not seekable): placeholders, readable by soundfile."""
    code = (
        "import sys, numpy as np\n"
        "from personaplex_cli.audio.wav import WavWriter\n"
        "assert not sys.stdout.buffer.seekable()\n"
        "x = np.sin(np.arange(4800) / 10).astype(np.float32) * 0.5\n"
        "with WavWriter(sys.stdout.buffer, 24000, sample_format=sys.argv[1]) as w:\n"
        "    for i in range(0, 4800, 1000):\n"
        "        w.write(x[i:i + 1000])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    x = (np.sin(np.arange(4800) / 10).astype(np.float32) * 0.5)
    for fmt, hs in (("s16", 44), ("f32", 58)):
        proc = subprocess.run([sys.executable, "-c", code, fmt], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, check=True)
        data = proc.stdout
        assert _sizes(data, hs) == (UNKNOWN, UNKNOWN)
        y, sr = sf.read(io.BytesIO(data), dtype="float32")
        assert sr == 24000 and len(y) == 4800
        tol = 0 if fmt == "f32" else 1 / 32767
        assert np.abs(y - x).max() <= tol


def _read_through_fifo(tmp_path, data: bytes, said: list | None = None):
    """open_audio() on a FIFO fed with `data`: (declared_frames, samples); its warnings go
    into `said`."""
    import threading

    from personaplex_cli.audio.io import open_audio

    said = [] if said is None else said

    fifo = tmp_path / "fifo.wav"
    os.mkfifo(fifo)
    t = threading.Thread(target=lambda: fifo.write_bytes(data), daemon=True)
    t.start()
    try:
        with open_audio(fifo, warn=said.append) as r:
            declared = r.declared_frames
            blocks = list(r.blocks(1000))
        return declared, np.concatenate(blocks)
    finally:
        t.join(5)
        fifo.unlink()


@pytest.mark.parametrize("fmt", ["s16", "f32"])
def test_streamed_wav_reads_back_with_its_length(tmp_path, fmt):
    x = _signal(2345) * 0.5
    exact, unknown = PipeLike(), PipeLike()
    with WavWriter(exact, 24000, sample_format=fmt, num_frames=2345) as w:
        w.write(x)
    with WavWriter(unknown, 24000, sample_format=fmt) as w:
        w.write(x)
    declared, y = _read_through_fifo(tmp_path, exact.getvalue())
    assert declared == 2345 and len(y) == 2345  # exact header: the length is declared
    declared, y = _read_through_fifo(tmp_path, unknown.getvalue())
    assert declared is None and len(y) == 2345  # placeholders: read to EOF


def test_crashed_stream_reads_back_short(tmp_path):
    """A pipe writer that declared its length and then failed leaves a short WAV: a file
    is truncated, an error; on a pipe it cannot be told from a writer's estimate (sox), so
    what came is read, and said."""
    from personaplex_cli.errors import AudioError
    from personaplex_cli.audio.io import open_audio

    pipe = PipeLike()
    with pytest.raises(RuntimeError):
        with WavWriter(pipe, 24000, num_frames=48000) as w:
            w.write(_signal(12000))
            raise RuntimeError("model crashed")
    said = []
    declared, y = _read_through_fifo(tmp_path, pipe.getvalue(), said)
    assert declared == 48000 and len(y) == 12000
    assert said == [f"{tmp_path / 'fifo.wav'} ends after 0.50 s of the 2.00 s its WAV header "
                    "declares, a length that writers on a pipe can only estimate; using the "
                    "0.50 s it holds"]
    (tmp_path / "crashed.wav").write_bytes(pipe.getvalue())
    with pytest.raises(AudioError, match="truncated WAV: .* ends after 0.50 s of the 2.00 s"):
        open_audio(tmp_path / "crashed.wav")


def test_on_a_pipe_the_header_goes_out_with_the_first_samples():
    """A reader that takes what one read brings as the header (sox on a pipe: "RIFF header
    not found") never sees the header alone: on a pipe it goes out in the same write as
    the first samples; with no samples at all, at close. A file gets it at once."""
    class Writes(PipeLike):
        def __init__(self):
            super().__init__()
            self.calls: list[bytes] = []

        def write(self, data):
            self.calls.append(bytes(data))
            return super().write(data)

    pipe = Writes()
    with WavWriter(pipe, 24000, num_frames=4) as writer:
        assert pipe.calls == []
        writer.write(np.zeros(2, np.float32))
        writer.write(np.zeros(2, np.float32))
    assert [len(call) for call in pipe.calls] == [44 + 4, 4]
    empty = Writes()
    WavWriter(empty, 24000, num_frames=0).close()
    assert [len(call) for call in empty.calls] == [44]
    file = io.BytesIO()
    WavWriter(file, 24000)
    assert len(file.getvalue()) == 44
