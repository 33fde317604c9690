"""Tests for reading audio (audio.io) and streaming resampling (audio.resample)."""

import io
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from personaplex_cli.audio.errors import AudioError
from personaplex_cli.audio.io import open_audio
from personaplex_cli.audio.resample import Reframer, StreamResampler
from personaplex_cli.audio.wav import WavWriter

REPO = Path(__file__).resolve().parents[1]

# Child process: read its stdin with open_audio("-"), save the samples, print the metadata.
_CHILD = (
    "import json, sys, numpy as np\n"
    "from personaplex_cli.audio.io import open_audio\n"
    "from personaplex_cli.audio.errors import AudioError\n"
    "try:\n"
    "    r = open_audio('-')\n"
    "    x = np.concatenate([np.zeros(0, np.float32)] + list(r.blocks(1000)))\n"
    "except AudioError as e:\n"
    "    print(json.dumps({'error': str(e)})); sys.exit(0)\n"
    "np.save(sys.argv[1], x)\n"
    "print(json.dumps({'sr': r.sample_rate, 'channels': r.channels, 'num_frames': r.num_frames,\n"
    "                  'seekable': sys.stdin.buffer.seekable()}))\n"
)


def _child_read(data: bytes, tmp_path):
    out = tmp_path / "child.npy"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(out)], input=data,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    meta = json.loads(proc.stdout)
    return meta, (np.load(out) if "error" not in meta else None)


@pytest.fixture
def stdin_pipe(monkeypatch):
    """Replace sys.stdin with a real OS pipe fed by a thread; returns feed(bytes)."""
    opened = []

    def feed(data: bytes):
        r, w = os.pipe()

        def writer():
            with os.fdopen(w, "wb") as f:
                try:
                    f.write(data)
                except BrokenPipeError:  # the reader gave up early (error cases)
                    pass

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        stdin = io.TextIOWrapper(os.fdopen(r, "rb"))
        opened.append((t, stdin))
        monkeypatch.setattr(sys, "stdin", stdin)

    yield feed
    for t, stdin in opened:
        stdin.close()  # unblocks a writer still waiting on a full pipe
        t.join(timeout=5)


def _read_all(reader, n=1000):
    blocks = list(reader.blocks(n))
    return blocks, (np.concatenate(blocks) if blocks else np.zeros(0, np.float32))


def _wav_bytes(x, sr=24000, subtype="PCM_16", fmt="WAV"):
    buf = io.BytesIO()
    sf.write(buf, x, sr, subtype=subtype, format=fmt)
    return buf.getvalue()


def _noise(n, channels=1, seed=0, scale=0.5):
    x = np.random.default_rng(seed).uniform(-scale, scale, (n, channels)).astype(np.float32)
    return x[:, 0] if channels == 1 else x


# --- regular files ----------------------------------------------------------------------


def test_file_blocks_and_metadata(tmp_path):
    x = _noise(2500)
    path = tmp_path / "a.wav"
    sf.write(path, x, 16000, subtype="FLOAT")
    with open_audio(path) as r:
        assert (r.sample_rate, r.channels, r.num_frames) == (16000, 1, 2500)
        blocks, y = _read_all(r, 1000)
    assert [len(b) for b in blocks] == [1000, 1000, 500]
    assert all(b.dtype == np.float32 and b.ndim == 1 for b in blocks)
    assert y.tobytes() == x.tobytes()


def test_stereo_mixdown(tmp_path):
    x = _noise(1200, channels=2)
    path = tmp_path / "st.flac"
    sf.write(path, x, 44100, subtype="PCM_24")
    with open_audio(str(path)) as r:
        assert r.channels == 2
        _, y = _read_all(r, 512)
    expected = sf.read(path, dtype="float32")[0].mean(axis=1)
    np.testing.assert_allclose(y, expected, atol=1e-7)


def test_nan_in_float_wav_file(tmp_path):
    x = np.zeros(24000 * 3, np.float32)
    x[int(24000 * 2.5)] = np.nan
    path = tmp_path / "nan.wav"
    sf.write(path, x, 24000, subtype="FLOAT")
    r = open_audio(path)
    with pytest.raises(AudioError, match=r"NaN or infinite samples at second 2\.50"):
        _read_all(r, 1920)


def test_file_errors(tmp_path):
    with pytest.raises(AudioError, match="no such file"):
        open_audio(tmp_path / "missing.wav")
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(AudioError, match="empty"):
        open_audio(empty)
    trunc = tmp_path / "trunc.wav"
    trunc.write_bytes(_wav_bytes(_noise(100))[:30])
    with pytest.raises(AudioError, match="truncated or corrupt WAV"):
        open_audio(trunc)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(np.random.default_rng(1).bytes(5000))
    with pytest.raises(AudioError, match="not an audio file or unsupported format: .*junk.bin"):
        open_audio(junk)
    with pytest.raises(AudioError, match="directory"):
        open_audio(tmp_path)


def test_error_messages_are_one_line(tmp_path):
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunk")
    with pytest.raises(AudioError) as e:
        open_audio(junk)
    assert "\n" not in str(e.value) and e.value.__cause__ is None


# --- stdin / pipes ----------------------------------------------------------------------


def test_wav_on_stdin_subprocess_with_placeholders(tmp_path):
    x = _noise(5000)
    buf = io.BytesIO()
    buf.seekable = lambda: False  # keep the 0xFFFFFFFF placeholders, as a streaming producer would
    with WavWriter(buf, 24000, sample_format="f32") as w:
        w.write(x)
    assert buf.getvalue()[54:58] == b"\xff" * 4
    meta, y = _child_read(buf.getvalue(), tmp_path)
    assert meta == {"sr": 24000, "channels": 1, "num_frames": None, "seekable": False}
    assert y.tobytes() == x.tobytes()


def test_flac_on_stdin_subprocess_is_buffered(tmp_path):
    x = _noise(3000, channels=2)
    meta, y = _child_read(_wav_bytes(x, 44100, "PCM_16", "FLAC"), tmp_path)
    assert (meta["sr"], meta["channels"], meta["num_frames"]) == (44100, 2, None)
    ref = sf.read(io.BytesIO(_wav_bytes(x, 44100, "PCM_16", "FLAC")), dtype="float32")[0]
    np.testing.assert_allclose(y, ref.mean(axis=1), atol=1e-7)


def test_errors_on_stdin_subprocess(tmp_path):
    assert "empty input" in _child_read(b"", tmp_path)[0]["error"]
    meta, _ = _child_read(b"hello, this is not audio\n" * 10, tmp_path)
    assert meta["error"] == "not an audio file or unsupported format: stdin"


@pytest.mark.parametrize("subtype,fmt,tol", [
    ("PCM_U8", "WAV", 0), ("PCM_16", "WAV", 0), ("PCM_24", "WAV", 0), ("PCM_32", "WAV", 0),
    ("FLOAT", "WAV", 0), ("DOUBLE", "WAV", 0), ("PCM_24", "WAVEX", 0), ("FLOAT", "WAVEX", 0),
    ("ALAW", "WAV", 0),  # not streamed: replayed to soundfile
])
def test_wav_encodings_on_a_pipe_match_soundfile(stdin_pipe, subtype, fmt, tol):
    x = _noise(3001, channels=2, seed=3)
    data = _wav_bytes(x, 22050, subtype, fmt)
    stdin_pipe(data)
    with open_audio("-") as r:
        assert (r.sample_rate, r.channels, r.num_frames) == (22050, 2, None)
        _, y = _read_all(r, 700)
    ref = sf.read(io.BytesIO(data), dtype="float32")[0].mean(axis=1, dtype=np.float32)
    np.testing.assert_allclose(y, ref, atol=1e-7)


def _handmade_wav(samples_s16, data_size=None, chunks=b"", trailer=b"", channels=1, sr=8000):
    payload = np.asarray(samples_s16, "<i2").tobytes()
    size = len(payload) if data_size is None else data_size
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, channels, sr, sr * 2 * channels,
                      2 * channels, 16)
    return (struct.pack("<4sI4s", b"RIFF", 0xFFFFFFFF, b"WAVE") + fmt + chunks
            + struct.pack("<4sI", b"data", size) + payload + trailer)


@pytest.mark.parametrize("data_size", [0, 0xFFFFFFFF, 0x7FFFF000, 0x7FFFFFFF, 10 ** 6])
def test_pipe_unknown_or_overstated_size_reads_to_eof(stdin_pipe, data_size):
    s = np.arange(-500, 500, dtype=np.int16) * 30
    stdin_pipe(_handmade_wav(s, data_size, trailer=b"\x01"))  # odd trailing byte: partial frame
    with open_audio("-") as r:
        _, y = _read_all(r, 128)
    np.testing.assert_array_equal(y, s / 32768.0)


def test_pipe_skips_unknown_chunks_and_stops_at_data_size(stdin_pipe):
    s = np.arange(100, dtype=np.int16)
    odd = struct.pack("<4sI", b"LIST", 5) + b"abcde\x00"  # odd size + pad byte
    junk = struct.pack("<4sI", b"junk", 70000) + bytes(70000)  # bigger than a skip piece
    trailer = struct.pack("<4sI", b"LIST", 4) + b"tail"  # after data: not audio
    stdin_pipe(_handmade_wav(s, chunks=odd + junk, trailer=trailer))
    with open_audio("-") as r:
        _, y = _read_all(r, 64)
    np.testing.assert_array_equal(y, s / 32768.0)


def test_pipe_errors(stdin_pipe):
    stdin_pipe(b"")
    with pytest.raises(AudioError, match="empty input: stdin"):
        open_audio("-")
    stdin_pipe(_handmade_wav([1, 2, 3])[:30])
    with pytest.raises(AudioError, match="truncated WAV header"):
        open_audio("-")
    stdin_pipe(_handmade_wav([1, 2, 3])[:40])
    with pytest.raises(AudioError, match="truncated WAV header"):
        open_audio("-")
    stdin_pipe(_handmade_wav([1, 2, 3], channels=0))
    with pytest.raises(AudioError, match="zero channels"):
        open_audio("-")
    stdin_pipe(np.random.default_rng(2).bytes(4096))
    with pytest.raises(AudioError, match="not an audio file or unsupported format: stdin"):
        open_audio("-")


def test_pipe_nan_and_inf(stdin_pipe):
    x = np.zeros(24000, np.float32)
    x[12000] = np.inf
    stdin_pipe(_wav_bytes(x, 24000, "FLOAT"))
    r = open_audio("-")
    with pytest.raises(AudioError, match=r"at second 0\.50"):
        _read_all(r, 1920)


def test_fifo_path_is_streamed(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    x = _noise(1000)
    data = _wav_bytes(x, 24000, "FLOAT")
    t = threading.Thread(target=lambda: fifo.write_bytes(data), daemon=True)
    t.start()
    with open_audio(fifo) as r:
        assert r.num_frames is None
        _, y = _read_all(r)
    t.join(5)
    assert y.tobytes() == x.tobytes()


# --- resampling and re-framing --------------------------------------------------------------


def test_resample_44k1_sine_in_blocks():
    sr_in, seconds, f0 = 44100, 1.0, 1000.0
    t = np.arange(int(sr_in * seconds)) / sr_in
    x = (0.5 * np.sin(2 * np.pi * f0 * t)).astype(np.float32)
    rs = StreamResampler(sr_in, 24000)
    out, i = [], 0
    for size in [1, 1000, 4410, 333, 8192] * 100:
        if i >= len(x):
            break
        out.append(rs.process(x[i:i + size]))
        i += size
    out.append(rs.flush())
    y = np.concatenate(out)
    assert y.dtype == np.float32
    assert abs(len(y) - 24000) <= 2
    t24 = np.arange(len(y)) / 24000
    ref = 0.5 * np.sin(2 * np.pi * f0 * t24)
    mid = slice(1000, len(y) - 1000)  # away from the filter's edges
    assert np.abs(y[mid] - ref[mid]).max() < 1e-3
    with pytest.raises(ValueError):
        rs.process(x[:10])


def test_resample_passthrough_is_bit_exact():
    x = _noise(5000, scale=3.0)
    rs = StreamResampler(24000, 24000)
    assert rs.passthrough
    y = rs.process(x)
    assert y.tobytes() == x.tobytes()
    assert len(rs.flush()) == 0


def test_reframer():
    rf = Reframer(1920)
    x = np.arange(1920 * 3 + 100, dtype=np.float32)
    frames, i = [], 0
    for size in [5, 1919, 1, 3000, 7, 928]:
        rf.push(x[i:i + size])
        i += size
        frames += rf.pop_frames()
    assert i == len(x)
    assert [len(f) for f in frames] == [1920] * 3
    np.testing.assert_array_equal(np.concatenate(frames), x[:1920 * 3])
    last, n = rf.flush_padded()
    assert n == 100 and len(last) == 1920
    np.testing.assert_array_equal(last[:100], x[-100:])
    assert not last[100:].any()
    assert rf.flush_padded() == (None, 0)


def test_reframer_refuses_to_flush_complete_frames():
    rf = Reframer(4)
    rf.push(np.ones(5, np.float32))
    with pytest.raises(ValueError):
        rf.flush_padded()
    assert len(rf.pop_frames()) == 1 and rf.pending == 1
