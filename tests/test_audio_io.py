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

import soxr

from personaplex_cli.errors import AudioError
from personaplex_cli.audio.io import open_audio
from personaplex_cli.audio.resample import Reframer, StreamResampler, resampled_length
from personaplex_cli.audio.wav import WavWriter
from personaplex_cli.errors import EXIT_BAD_INPUT

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "audio"

# Child process: read its stdin with open_audio("-"), save the samples, print the metadata.
_CHILD = (
    "import json, sys, numpy as np\n"
    "from personaplex_cli.audio.io import open_audio\n"
    "from personaplex_cli.errors import AudioError\n"
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
    assert (meta["sr"], meta["channels"], meta["num_frames"]) == (44100, 2, 3000)
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
        assert (r.sample_rate, r.channels, r.declared_frames) == (22050, 2, 3001)
        # Streamed, the header's count is only a claim; buffered, libsndfile counts.
        assert r.num_frames == (3001 if subtype == "ALAW" else None)
        _, y = _read_all(r, 700)
    ref = sf.read(io.BytesIO(data), dtype="float32")[0].mean(axis=1, dtype=np.float32)
    np.testing.assert_array_equal(y, ref)


def _handmade_wav(samples_s16, data_size=None, chunks=b"", trailer=b"", channels=1, sr=8000):
    payload = np.asarray(samples_s16, "<i2").tobytes()
    size = len(payload) if data_size is None else data_size
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, channels, sr, sr * 2 * channels,
                      2 * channels, 16)
    return (struct.pack("<4sI4s", b"RIFF", 0xFFFFFFFF, b"WAVE") + fmt + chunks
            + struct.pack("<4sI", b"data", size) + payload + trailer)


@pytest.mark.parametrize("data_size", [0, 0xFFFFFFFF, 0x7FFFF000, 0x7FFFF024, 0x7FFFFFFF])
def test_pipe_placeholder_size_reads_to_eof(stdin_pipe, data_size):
    s = np.arange(-500, 500, dtype=np.int16) * 30
    stdin_pipe(_handmade_wav(s, data_size, trailer=b"\x01"))  # odd trailing byte: partial frame
    with open_audio("-") as r:
        assert r.num_frames is None
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
        assert (r.num_frames, r.declared_frames) == (None, 1000)  # the header's claim
        _, y = _read_all(r)
    t.join(5)
    assert y.tobytes() == x.tobytes()


# --- exact lengths (num_frames) -------------------------------------------------------------


def test_pipe_wav_with_a_real_data_size_declares_its_length(stdin_pipe):
    s = np.arange(-700, 700, 3, dtype=np.int16)
    stdin_pipe(_handmade_wav(np.repeat(s, 2), channels=2, sr=16000))
    with open_audio("-") as r:
        assert (r.num_frames, r.declared_frames, r.duration) == (None, len(s), len(s) / 16000)
        blocks, y = _read_all(r, 100)
    assert len(y) == len(s) and len(blocks[-1]) == len(s) % 100


def _mp3_without_xing_tag(data: bytes) -> bytes:
    """Drop the first MPEG frame of a soundfile/LAME MP3: the one holding the Xing/Info tag."""
    b1, b2 = data[1], data[2]
    mpeg1 = (b1 >> 3) & 3 == 3
    kbps = ([0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320] if mpeg1 else
            [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160])[b2 >> 4]
    rate = ([44100, 48000, 32000] if mpeg1 else [22050, 24000, 16000])[(b2 >> 2) & 3]
    size = (144 if mpeg1 else 72) * kbps * 1000 // rate + ((b2 >> 1) & 1)
    assert data[:1] == b"\xff" and (b"Xing" in data[:size] or b"Info" in data[:size])
    assert data[size] == 0xFF and data[size + 1] & 0xE0 == 0xE0  # the next frame's sync
    return data[size:]


def _flac_without_total(data: bytes) -> bytes:
    """Zero STREAMINFO's 36-bit total sample count, as an encoder writing to a pipe leaves it."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # first metadata block: STREAMINFO
    field = int.from_bytes(data[18:26], "big") & ~((1 << 36) - 1)
    return data[:18] + field.to_bytes(8, "big") + data[26:]


def _encoded(kind: str) -> tuple[bytes, bytes]:
    """(bytes of a test input, bytes for the whole-file reference read).

    The stored MP3s are espeak-ng speech (tests/data/audio). The reference
    differs only for a FLAC without its total: `soundfile.read()` cannot read
    one whole (it allocates the unknown length), so the same FLAC with the
    count is read instead (the frames, hence the samples, are the same).
    """
    if kind.endswith(".mp3"):
        data = (DATA / kind).read_bytes()
        return data, data
    fmt, sub, sr, ch = {
        "wav16": ("WAV", "PCM_16", 24000, 1), "wavf": ("WAV", "FLOAT", 44100, 2),
        "flac": ("FLAC", "PCM_24", 44100, 2), "flac-no-total": ("FLAC", "PCM_16", 16000, 1),
        "vorbis": ("OGG", "VORBIS", 22050, 1), "opus": ("OGG", "OPUS", 48000, 2),
        "mp3-22k": ("MP3", "MPEG_LAYER_III", 22050, 1),
        "mp3-44k": ("MP3", "MPEG_LAYER_III", 44100, 2),
        "mp3-no-tag": ("MP3", "MPEG_LAYER_III", 22050, 2), "aiff": ("AIFF", "PCM_16", 11025, 2),
    }[kind]
    t = np.arange(int(sr * 0.77)) / sr
    x = 0.3 * np.sin(2 * np.pi * 330 * t)[:, None] + _noise(len(t), ch, seed=5, scale=0.1)\
        .reshape(len(t), ch)
    data = _wav_bytes(x[:, 0] if ch == 1 else x, sr, sub, fmt)
    if kind == "mp3-no-tag":
        data = _mp3_without_xing_tag(data)
    if kind == "flac-no-total":
        return _flac_without_total(data), data
    return data, data


ALL_KINDS = ["wav16", "wavf", "flac", "flac-no-total", "vorbis", "opus", "mp3-22k", "mp3-44k",
             "mp3-no-tag", "speech-22k-mono-cbr.mp3", "speech-44k-stereo-vbr.mp3", "aiff"]


def _whole_read(file) -> np.ndarray:
    x = sf.read(io.BytesIO(file) if isinstance(file, bytes) else file, dtype="float32",
                always_2d=True)[0]
    return x.mean(axis=1, dtype=np.float32) if x.shape[1] > 1 else x[:, 0]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_lengths_are_exact_from_a_file_and_a_pipe(kind, tmp_path, stdin_pipe):
    data, reference = _encoded(kind)
    path = tmp_path / "in.audio"
    path.write_bytes(data)
    whole = _whole_read(reference)
    with open_audio(path) as r:
        assert r.num_frames == r.declared_frames == len(whole)
        assert len(_read_all(r, 4096)[1]) == len(whole)
    stdin_pipe(data)
    with open_audio("-") as r:
        # A WAV streamed from a pipe declares a length nothing can check up front.
        assert r.num_frames == (None if kind.startswith("wav") else len(whole))
        assert r.declared_frames == len(whole)
        assert len(_read_all(r, 4096)[1]) == len(whole)


def test_mp3_length_is_counted_not_estimated(tmp_path):
    path = DATA / "speech-22k-mono-cbr.mp3"
    assert sf.info(str(path)).frames == 78125  # libsndfile's estimate (no Xing tag)...
    assert len(_whole_read(path)) == 77760  # ...and what decodes
    with open_audio(path) as r:
        assert r.num_frames == 77760


# --- block reads are whole-file reads -------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_block_reads_equal_a_whole_file_read(kind, tmp_path, stdin_pipe):
    data, reference = _encoded(kind)
    path = tmp_path / "in.audio"
    path.write_bytes(data)
    whole = _whole_read(reference)
    if reference == data:
        np.testing.assert_array_equal(whole, _whole_read(path))  # file == in memory
    for n in (1000, 1152, 4410, 65536):
        with open_audio(path) as r:
            blocks, y = _read_all(r, n)
        assert all(len(b) == n for b in blocks[:-1])
        np.testing.assert_array_equal(y, whole, err_msg=f"file, blocks of {n}")
    for n in (777, 4096):
        stdin_pipe(data)
        with open_audio("-") as r:
            _, y = _read_all(r, n)
        np.testing.assert_array_equal(y, whole, err_msg=f"pipe, blocks of {n}")


def test_tiny_blocks_mp3(tmp_path):
    path = DATA / "speech-22k-mono-cbr.mp3"
    with open_audio(path) as r:
        _, y = _read_all(r, 7)
    np.testing.assert_array_equal(y, _whole_read(path))


# Child: decode a file with open_audio in small blocks while a thread writes to sys.stderr.
_QUIET_CHILD = (
    "import sys, threading, numpy as np\n"
    "from personaplex_cli.audio import io as aio\n"
    "if sys.argv[2] != 'auto':\n"
    "    aio._quiet._mode = sys.argv[2]\n"
    "def ticks():\n"
    "    for i in range(300):\n"
    "        sys.stderr.write(f'tick {i}\\n'); sys.stderr.flush()\n"
    "t = threading.Thread(target=ticks) if sys.argv[2] != 'fd' else None\n"
    "t and t.start()\n"
    "for _ in range(3):\n"
    "    with aio.open_audio(sys.argv[1]) as r:\n"
    "        n = sum(len(b) for b in r.blocks(500))\n"
    "t and t.join()\n"
    "print(n, aio._quiet._mode)\n"
)


def _half_mp3(tmp_path) -> Path:
    """A 22.05 kHz MP3 cut in half: its Xing tag then overstates the size, and libmpg123 warns."""
    data = _wav_bytes(_noise(22050 * 3, seed=9, scale=0.3), 22050, "MPEG_LAYER_III", "MP3")
    path = tmp_path / "half.mp3"
    path.write_bytes(data[:len(data) // 2])
    return path


def test_library_messages_never_reach_stderr(tmp_path):
    path = _half_mp3(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # The input does make libmpg123 talk when soundfile reads it plainly...
    plain = subprocess.run(
        [sys.executable, "-c", "import sys, soundfile as sf\n"
         "f = sf.SoundFile(sys.argv[1])\nwhile len(f.read(500)): pass", str(path)],
        capture_output=True, env=env, check=True)
    assert b"Xing stream size" in plain.stderr or b"libmpg123" in plain.stderr
    # ...but not through open_audio, while Python's own stderr output all arrives.
    for mode in ("auto", "fd"):
        proc = subprocess.run([sys.executable, "-c", _QUIET_CHILD, str(path), mode],
                              capture_output=True, env=env, check=True, timeout=120)
        count, used = proc.stdout.split()
        assert int(count) > 10000
        lines = proc.stderr.decode().splitlines()
        if mode == "auto":
            assert used == b"stdio"  # glibc: the C `stderr` stream is swapped, fd 2 is not
            assert lines == [f"tick {i}" for i in range(300)]
        else:
            assert lines == []


# --- truncated WAVs -------------------------------------------------------------------------


def _one_second_wav() -> bytes:
    return _wav_bytes(_noise(24000, seed=4), 24000, "PCM_16")


def test_truncated_wav_file_is_an_error(tmp_path):
    data = _one_second_wav()
    path = tmp_path / "in.wav"
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(AudioError) as e:
        open_audio(path)
    assert str(e.value) == (f"truncated WAV: {path} ends after 0.50 s of the 1.00 s its "
                            "header declares")
    assert e.value.exit_code == EXIT_BAD_INPUT


SHORT_PIPE_WARNING = ("stdin ends after 0.50 s of the 1.00 s its WAV header declares, a "
                      "length that writers on a pipe can only estimate; using the 0.50 s "
                      "it holds")


def test_short_wav_on_a_pipe_is_read_to_its_end_with_one_warning(stdin_pipe):
    """sox and other writers that cannot seek back declare an estimated length on a pipe
    (issue 13): what arrives is the input, and the user hears of it once."""
    data = _one_second_wav()
    stdin_pipe(data[:len(data) // 2])
    said = []
    with open_audio("-", warn=said.append) as r:
        assert (r.num_frames, r.declared_frames) == (None, 24000)
        _, y = _read_all(r, 1920)
    assert said == [SHORT_PIPE_WARNING]
    assert len(y) == (len(data) // 2 - 44) // 2  # everything present was read
    np.testing.assert_array_equal(y, sf.read(io.BytesIO(data), dtype="float32")[0][:len(y)])


def test_short_wav_subprocess_stdin(tmp_path):
    data = _one_second_wav()
    meta, y = _child_read(data[:len(data) // 2], tmp_path)
    assert "error" not in meta and len(y) == (len(data) // 2 - 44) // 2


def test_short_buffered_wav_on_a_pipe(stdin_pipe):
    data = _wav_bytes(_noise(8000, seed=6), 8000, "ALAW")  # not streamed: buffered whole
    stdin_pipe(data[:len(data) - 4000])
    said = []
    with open_audio("-", warn=said.append) as r:
        assert r.num_frames == r.declared_frames == 4000  # all of it is here: exact
        assert len(_read_all(r)[1]) == 4000
    assert said == [SHORT_PIPE_WARNING]


def test_truncation_message_in_samples_when_seconds_look_equal(tmp_path):
    s = np.arange(160, dtype=np.int16)  # 0.02 s at 8 kHz
    path = tmp_path / "short.wav"
    path.write_bytes(_handmade_wav(s)[:-4])  # 0.01975 s
    with pytest.raises(AudioError, match=r"ends after 158 samples of the 160 samples"):
        open_audio(path)


@pytest.mark.parametrize("data_size", [0xFFFFFFFF, 0x7FFFF000])
def test_placeholder_sizes_in_files_are_not_truncation(tmp_path, data_size):
    s = np.arange(-300, 300, dtype=np.int16)
    path = tmp_path / "ph.wav"
    path.write_bytes(_handmade_wav(s, data_size))
    with open_audio(path) as r:
        assert r.num_frames == 600
        np.testing.assert_array_equal(_read_all(r)[1], s / 32768.0)


def test_chunks_after_the_data_are_not_truncation(tmp_path):
    s = np.arange(50, dtype=np.int16)
    path = tmp_path / "list.wav"
    path.write_bytes(_handmade_wav(s, trailer=struct.pack("<4sI", b"LIST", 4) + b"tail"))
    with open_audio(path) as r:
        assert r.num_frames == 50


@pytest.mark.parametrize("cut,frames,last_is_zero", [
    (0, 250, False),  # complete
    (1, 250, True),  # one byte of the last frame missing: tolerated, reads as silence
    (3, 250, True),
])
def test_last_frame_short_by_a_byte_or_so(tmp_path, stdin_pipe, cut, frames, last_is_zero):
    s = np.arange(1, 501, dtype=np.int16)  # stereo: 250 frames of 4 bytes
    data = _handmade_wav(s, channels=2)
    data = data[:len(data) - cut]
    path = tmp_path / "cut.wav"
    path.write_bytes(data)
    results = []
    with open_audio(path) as r:
        results.append((r.num_frames, _read_all(r, 64)[1]))
    stdin_pipe(data)
    with open_audio("-") as r:
        results.append((r.declared_frames, _read_all(r, 64)[1]))
    expected = (s[0::2] / 32768.0 + s[1::2] / 32768.0) / 2
    for num_frames, y in results:
        assert num_frames == frames and len(y) == frames
        np.testing.assert_allclose(y[:-1], expected[:-1], atol=1e-7)
        assert (y[-1] == 0) == last_is_zero
    np.testing.assert_array_equal(results[0][1], results[1][1])  # file == pipe


def test_a_whole_frame_missing_is_truncation(tmp_path, stdin_pipe):
    data = _handmade_wav(np.arange(1, 501, dtype=np.int16), channels=2)[:-4]
    path = tmp_path / "cut.wav"
    path.write_bytes(data)
    with pytest.raises(AudioError, match="ends after 249 samples of the 250 samples"):
        open_audio(path)
    stdin_pipe(data)  # on a pipe: read to its end, and said
    said = []
    with open_audio("-", warn=said.append) as r:
        assert len(_read_all(r)[1]) == 249
    assert len(said) == 1 and "ends after 249 samples of the 250 samples" in said[0]


def test_odd_declared_size_is_not_truncation(tmp_path, stdin_pipe):
    s = np.arange(100, dtype=np.int16)
    data = _handmade_wav(s, data_size=201)  # 100.5 frames declared, 100 present
    path = tmp_path / "odd.wav"
    path.write_bytes(data)
    for source in (path, "-"):
        if source == "-":
            stdin_pipe(data)
        with open_audio(source) as r:
            assert r.declared_frames == 100
            np.testing.assert_array_equal(_read_all(r)[1], s / 32768.0)


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


RATES = [8000, 11025, 16000, 22050, 24000, 44100, 48000, 96000, 192000, 23999, 7919]
LENGTHS = [0, 1, 2, 3, 5, 17, 99, 1000, 1919, 1920, 1921, 4409, 4410, 4411, 33333]
BLOCKINGS = [None, [1000], [7, 333, 4096], [1920]]  # None = the whole input at once


def _soxr_total(n: int, in_rate: int, out_rate: int, blocking, quality="HQ") -> int:
    """Samples soxr itself emits (every chunk plus the final flush) for n samples in."""
    stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=quality)
    x = np.zeros(n, np.float32)
    sizes = blocking or [max(n, 1)]
    total, i, k = 0, 0, 0
    while i < n:
        size = sizes[k % len(sizes)]
        total += len(stream.resample_chunk(x[i:i + size]))
        i, k = i + size, k + 1
    return total + len(stream.resample_chunk(np.zeros(0, np.float32), last=True))


def _pairs():
    # Every rate to and from 24 kHz (encode, decode --rate), plus odd pairs.
    pairs = {(r, 24000) for r in RATES} | {(24000, r) for r in RATES}
    pairs |= {(7919, 23999), (23999, 7919), (192000, 8000), (8000, 192000), (44100, 48000),
              (48000, 44100), (11025, 7919), (96000, 22050)}
    return sorted(pairs)


@pytest.mark.parametrize("in_rate,out_rate", _pairs())
def test_resampled_length_is_what_soxr_emits(in_rate, out_rate):
    rng = np.random.default_rng(in_rate * 7 + out_rate)
    lengths = LENGTHS + [int(n) for n in rng.integers(1, 50000, 2)]
    for n in lengths:
        expected = resampled_length(n, in_rate, out_rate)
        for blocking in BLOCKINGS + ([[1], [1, 2, 3]] if n < 2000 else []):
            assert _soxr_total(n, in_rate, out_rate, blocking) == expected, (n, blocking)


def test_resampled_length_ties_follow_soxr_double_arithmetic():
    # n * out / in is exactly x.5 in both: libsoxr's (double) n / (in / out) + .5 decides.
    assert resampled_length(1000, 24000, 44100) == 1837 == _soxr_total(1000, 24000, 44100, None)
    assert resampled_length(1000, 8000, 44100) == 5513 == _soxr_total(1000, 8000, 44100, None)
    assert resampled_length(3, 16000, 24000) == 5 == _soxr_total(3, 16000, 24000, None)
    assert resampled_length(12345, 24000, 24000) == 12345
    assert resampled_length(0, 44100, 24000) == 0
    assert resampled_length(3600 * 44100, 44100, 24000) == 3600 * 24000
    with pytest.raises(ValueError):
        resampled_length(-1, 44100, 24000)


@pytest.mark.parametrize("quality", ["QQ", "LQ", "MQ", "VHQ"])
def test_resampled_length_holds_for_other_qualities(quality):
    for in_rate, out_rate in [(44100, 24000), (24000, 44100), (7919, 24000), (23999, 24000)]:
        for n in (0, 1, 1000, 1921, 12345):
            for blocking in (None, [7, 333]):
                total = _soxr_total(n, in_rate, out_rate, blocking, quality)
                assert total == resampled_length(n, in_rate, out_rate)


@pytest.mark.parametrize("in_rate,out_rate", [(44100, 24000), (24000, 44100), (7919, 24000),
                                              (24000, 24000), (192000, 24000), (8000, 24000)])
def test_stream_resampler_total_is_resampled_length(in_rate, out_rate):
    x = _noise(30011, scale=0.9)
    for sizes in ([30011], [1], [7, 333, 4096], [1920], [0, 500]):
        rs = StreamResampler(in_rate, out_rate)
        total, i, k = 0, 0, 0
        while i < len(x):
            size = sizes[k % len(sizes)]
            total += len(rs.process(x[i:i + size]))
            i, k = i + size, k + 1
        total += len(rs.flush())
        assert total == resampled_length(len(x), in_rate, out_rate)
        assert (rs.samples_in, rs.samples_out) == (len(x), total)
        assert len(rs.flush()) == 0


def test_stream_resampler_flush_enforces_the_count():
    """Were soxr to end one sample short or long, flush() pads or trims to the rule."""
    class Skewed:
        def __init__(self, stream, skew):
            self.stream, self.skew = stream, skew

        def resample_chunk(self, x, last=False):
            out = self.stream.resample_chunk(x, last=last)
            if not last:
                return out
            return out[:len(out) - 1] if self.skew < 0 else np.concatenate([out, [0.5, 0.5]])

    for skew in (-1, 1):
        rs = StreamResampler(44100, 24000)
        rs._stream = Skewed(rs._stream, skew)
        total = len(rs.process(_noise(10000))) + len(rs.flush())
        assert total == resampled_length(10000, 44100, 24000)
