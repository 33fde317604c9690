"""Tests for the .mimi code container and .npy interchange (personaplex_cli.codes)."""

import io
import json
import os
import struct
import threading

import numpy as np
import pytest

from personaplex_cli import __version__
from personaplex_cli.codes import (TRAILER_SIZE, CodeFileError, CodeHeader, CodeReader,
                                   CodeWriter, load_npy, save_npy, sniff_format)

K = 8


class PipeLike(io.BytesIO):
    def seekable(self):
        return False


def _codes(n, k=K, seed=0):
    return np.random.default_rng(seed).integers(0, 2048, (k, n))


def _mimi_bytes(codes, **header_kw):
    buf = io.BytesIO()
    with CodeWriter(buf, CodeHeader(num_codebooks=codes.shape[0], **header_kw)) as w:
        w.write(codes)
    return buf.getvalue()


def _preamble(data):
    return struct.unpack_from("<4sBBHIQ", data, 0)


def test_round_trip_and_layout(tmp_path):
    codes = _codes(37)
    path = tmp_path / "x.mimi"
    header = CodeHeader(num_codebooks=K, num_samples=37 * 1920 - 100, weights_sha256="ab" * 32)
    with open(path, "wb") as f, CodeWriter(f, header) as w:
        w.write(codes[:, :10])
        w.write(codes[:, 10:])
    data = path.read_bytes()
    magic, version, flags, reserved, json_len, num_frames = _preamble(data)
    assert (magic, version, flags, reserved, num_frames) == (b"MIMI", 1, 1, 0, 37)
    assert json_len >= 512 and len(data) == 20 + json_len + 37 * K * 2
    meta = json.loads(data[20:20 + json_len])
    assert meta["tool"] == f"personaplex {__version__}"
    assert {k: meta[k] for k in ("codec", "version", "sample_rate", "frame_rate", "frame_size",
                                 "num_codebooks", "cardinality", "dtype", "layout")} == {
        "codec": "mimi", "version": 1, "sample_rate": 24000, "frame_rate": 12.5,
        "frame_size": 1920, "num_codebooks": K, "cardinality": 2048, "dtype": "uint16",
        "layout": "frame-major"}
    # frame-major: the first frame's K codes come first
    first = np.frombuffer(data, "<u2", count=K, offset=20 + json_len)
    np.testing.assert_array_equal(first, codes[:, 0])

    with open(path, "rb") as f:
        r = CodeReader(f)
        assert r.num_frames == 37 and r.header.num_samples == 37 * 1920 - 100
        assert r.header.weights_sha256 == "ab" * 32
        parts = list(r.frames(max_frames=16))
    assert [p.shape for p in parts] == [(K, 16), (K, 16), (K, 5)]
    assert all(p.dtype == np.int64 for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), codes)


def test_pipe_keeps_unknown_num_frames_and_reads_to_eof():
    codes = _codes(5)
    out = PipeLike()
    with CodeWriter(out, CodeHeader(num_codebooks=K, num_samples=5 * 1920 - 7)) as w:
        w.write(codes)  # num_samples known up front: no trailer needed
    data = out.getvalue()
    assert _preamble(data)[2] == 0 and _preamble(data)[5] == 0xFFFFFFFFFFFFFFFF
    r = CodeReader(io.BytesIO(data))
    assert r.num_frames is None and not r.has_trailer and r.num_samples == 5 * 1920 - 7
    np.testing.assert_array_equal(r.read_all(), codes)


def test_close_patches_num_samples_in_place():
    buf = io.BytesIO()
    w = CodeWriter(buf, CodeHeader(num_codebooks=4))
    before = len(buf.getvalue())
    w.write(_codes(3, k=4))
    w.close(num_samples=12345678901234567)
    data = buf.getvalue()
    assert len(data) == before + 3 * 4 * 2  # the JSON was rewritten in its reserved space
    r = CodeReader(io.BytesIO(data))
    assert r.header.num_samples == 12345678901234567 and r.num_frames == 3


def test_the_window_rule_is_recorded_and_older_files_read_as_kyutai():
    """Codes decode back to their maker's audio only under its attention window rule
    (reply's: NVIDIA's; encode's: Kyutai's), so the header records it (issue 13)."""
    data = _mimi_bytes(_codes(3), window="nvidia")
    meta = json.loads(data[20:20 + _preamble(data)[4]])
    assert meta["window"] == "nvidia"
    assert CodeReader(io.BytesIO(data)).header.window == "nvidia"
    assert CodeHeader(num_codebooks=K).window == "kyutai"
    del meta["window"]  # as every file written before the key
    old = CodeReader(io.BytesIO(_with_json(meta)))
    assert old.header.window == "kyutai" and old.header.extra == {}


def test_unknown_keys_are_ignored_and_kept():
    codes = _codes(2)
    data = bytearray(_mimi_bytes(codes))
    json_len = _preamble(data)[4]
    meta = json.loads(data[20:20 + json_len])
    meta["future_key"] = {"x": 1}
    body = json.dumps(meta).encode().ljust(json_len)
    data[20:20 + json_len] = body
    r = CodeReader(io.BytesIO(bytes(data)))
    assert r.header.extra == {"future_key": {"x": 1}}
    np.testing.assert_array_equal(r.read_all(), codes)


def test_read_while_being_written(tmp_path):
    path = tmp_path / "live.mimi"
    codes = _codes(8)
    with open(path, "wb") as wf, open(path, "rb") as rf:
        w = CodeWriter(wf, CodeHeader(num_codebooks=K))
        w.write(codes[:, :3])
        r = CodeReader(rf)
        assert r.num_frames is None
        got = list(r.frames(max_frames=2))
        np.testing.assert_array_equal(np.concatenate(got, axis=1), codes[:, :3])
        w.write(codes[:, 3:8])
        got = list(r.frames(max_frames=2))
        np.testing.assert_array_equal(np.concatenate(got, axis=1), codes[:, 3:8])
        w.close()


def test_reading_from_a_real_pipe():
    codes = _codes(50)
    data = _mimi_bytes(codes)
    rfd, wfd = os.pipe()

    def slow_writer():  # dribble bytes so reads come back short
        with os.fdopen(wfd, "wb", buffering=0) as f:
            for i in range(0, len(data), 333):
                f.write(data[i:i + 333])

    t = threading.Thread(target=slow_writer, daemon=True)
    t.start()
    with os.fdopen(rfd, "rb", buffering=0) as f:  # raw: short reads really happen
        r = CodeReader(f)
        parts = list(r.frames(max_frames=7))
    t.join(5)
    assert [p.shape[1] for p in parts] == [7] * 7 + [1]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), codes)


def test_prefix_bytes_from_sniffing():
    data = _mimi_bytes(_codes(4))
    stream = io.BytesIO(data)
    head = stream.read(8)
    assert sniff_format(head) == "mimi"
    np.testing.assert_array_equal(CodeReader(stream, prefix=head).read_all(), _codes(4))


def test_truncated_frame():
    data = _mimi_bytes(_codes(3))[:-3]
    r = CodeReader(io.BytesIO(data))
    frames = []
    with pytest.raises(CodeFileError, match="truncated frame at the end of the file"):
        for f in r.frames(max_frames=10):
            frames.append(f)
    assert sum(f.shape[1] for f in frames) == 2


def test_fewer_frames_than_declared():
    buf = PipeLike()
    w = CodeWriter(buf, CodeHeader(num_codebooks=K), num_frames=5)
    w.write(_codes(2))
    w.close()
    with pytest.raises(CodeFileError, match="declares 5 frames, found 2"):
        CodeReader(io.BytesIO(buf.getvalue())).read_all()


@pytest.mark.parametrize("mutate,message", [
    (lambda d: b"MIMX" + d[4:], "not a .mimi code file"),
    (lambda d: b"RIFF" + d[4:], "not a .mimi code file"),
    (lambda d: b"", "not a .mimi code file"),
    (lambda d: d[:4] + b"\x02" + d[5:], "unsupported .mimi format version 2"),
    (lambda d: d[:15], "truncated .mimi preamble"),
    (lambda d: d[:100], "truncated .mimi header"),
    (lambda d: d[:20] + b"{not json" + d[29:], "invalid JSON"),
])
def test_bad_preamble_and_header(mutate, message):
    with pytest.raises(CodeFileError, match=message):
        CodeReader(io.BytesIO(mutate(_mimi_bytes(_codes(2)))))


def _with_json(meta: dict) -> bytes:
    body = json.dumps(meta).encode()
    return struct.pack("<4sBBHIQ", b"MIMI", 1, 0, 0, len(body), 2 ** 64 - 1) + body


@pytest.mark.parametrize("change,message", [
    ({"num_codebooks": None}, "required keys: num_codebooks"),
    ({"cardinality": None}, "required keys: cardinality"),
    ({"num_codebooks": 0}, "num_codebooks must be 1..32"),
    ({"num_codebooks": 33}, "num_codebooks must be 1..32"),
    ({"num_codebooks": True}, "num_codebooks must be 1..32"),
    ({"cardinality": 1024}, "cardinality must be 2048"),
    ({"codec": "encodec"}, "unsupported codec"),
    ({"dtype": "int32"}, "unsupported code dtype"),
    ({"num_samples": -1}, "num_samples"),
    ({"window": "bogus"}, "window must be one of 'exact', 'kyutai', 'nvidia', got 'bogus'"),
])
def test_header_validation(change, message):
    meta = CodeHeader(num_codebooks=K).to_dict()
    for key, value in change.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    with pytest.raises(CodeFileError, match=message):
        CodeReader(io.BytesIO(_with_json(meta)))


def test_header_must_be_an_object():
    with pytest.raises(CodeFileError, match="not a JSON object"):
        CodeReader(io.BytesIO(_with_json([1, 2])))  # type: ignore[arg-type]


def test_out_of_range_code_in_file_names_the_frame():
    data = bytearray(_mimi_bytes(np.zeros((K, 4), np.int64)))
    json_len = _preamble(data)[4]
    struct.pack_into("<H", data, 20 + json_len + (2 * K + 3) * 2, 4000)  # frame 2, codebook 3
    with pytest.raises(CodeFileError, match=r"4000 >= cardinality 2048 in frame 2 \(codebook 3\)"):
        CodeReader(io.BytesIO(bytes(data))).read_all()


def test_writer_validation():
    w = CodeWriter(io.BytesIO(), CodeHeader(num_codebooks=K), num_frames=3)
    with pytest.raises(ValueError, match="shaped"):
        w.write(np.zeros((K - 1, 2), np.int64))
    with pytest.raises(ValueError, match="integers"):
        w.write(np.zeros((K, 2), np.float32))
    with pytest.raises(ValueError, match=r"\[0, 2048\)"):
        w.write(np.full((K, 2), 2048))
    with pytest.raises(ValueError, match=r"\[0, 2048\)"):
        w.write(np.full((K, 2), -1))
    w.write(np.zeros((K, 3), np.uint16))
    with pytest.raises(ValueError, match="exceed"):
        w.write(np.zeros((K, 1), np.uint16))
    with pytest.raises(CodeFileError):
        CodeWriter(io.BytesIO(), CodeHeader(num_codebooks=40))


def test_npy_round_trip_and_sniff():
    codes = _codes(20, k=16)
    buf = PipeLike()
    save_npy(buf, codes)
    data = buf.getvalue()
    assert sniff_format(data[:8]) == "npy"
    assert np.load(io.BytesIO(data)).dtype == np.uint16
    loaded = load_npy(io.BytesIO(data))
    assert loaded.dtype == np.int64
    np.testing.assert_array_equal(loaded, codes)
    stream = io.BytesIO(data)
    head = stream.read(8)
    np.testing.assert_array_equal(load_npy(stream, prefix=head), codes)
    assert sniff_format(b"RIFF....") is None and sniff_format(b"") is None


def _npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


@pytest.mark.parametrize("arr,message", [
    (np.zeros((8, 4), np.float32), "must be integers"),
    (np.zeros((8, 4), bool), "must be integers"),
    (np.zeros(8, np.int64), "2-D"),
    (np.zeros((1, 8, 4), np.int64), "2-D"),
    (np.zeros((33, 4), np.int64), "1..32"),
    (np.zeros((0, 4), np.int64), "1..32"),
    (np.full((8, 4), 2048), r"\[0, 2048\)"),
    (np.full((8, 4), -5), r"\[0, 2048\)"),
    (np.array([[{"a": 1}]], dtype=object), "not a valid .npy"),
])
def test_npy_validation(arr, message):
    with pytest.raises(CodeFileError, match=message):
        load_npy(io.BytesIO(_npy(arr)))


def test_npy_corrupt_inputs():
    with pytest.raises(CodeFileError, match="not a valid .npy"):
        load_npy(io.BytesIO(b"not an npy file at all"))
    with pytest.raises(CodeFileError, match="not a valid .npy"):
        load_npy(io.BytesIO(_npy(np.zeros((8, 100), np.uint16))[:-10]))
    with pytest.raises(CodeFileError):
        save_npy(io.BytesIO(), np.full((8, 2), 5000))


# --- the trailer (length of a stream whose length was unknown at the start) --------------


def _piped(codes, num_samples=None, close_with=None, num_frames=None):
    out = PipeLike()
    w = CodeWriter(out, CodeHeader(num_codebooks=codes.shape[0], num_samples=num_samples),
                   num_frames=num_frames)
    w.write(codes)
    w.close(num_samples=close_with)
    return w, out.getvalue()


def test_pipe_writer_without_num_samples_appends_a_trailer():
    codes = _codes(5)
    w, data = _piped(codes, close_with=5 * 1920 - 333)
    assert w.has_trailer
    magic, version, flags, _, json_len, num_frames = _preamble(data)
    assert flags == 0b10 and num_frames == 0xFFFFFFFFFFFFFFFF
    assert TRAILER_SIZE == 21 and len(data) == 20 + json_len + 5 * K * 2 + 21
    assert struct.unpack("<4sQQB", data[-21:]) == (b"MEND", 5, 5 * 1920 - 333, 0)
    r = CodeReader(io.BytesIO(data))
    assert r.has_trailer and r.num_samples is None and r.num_frames is None
    got = list(r.frames(max_frames=2))
    assert [g.shape[1] for g in got] == [2, 2, 1]
    np.testing.assert_array_equal(np.concatenate(got, axis=1), codes)
    assert (r.num_samples, r.num_frames, r.frames_read) == (5 * 1920 - 333, 5, 5)
    assert list(r.frames()) == []  # exhausted


def test_trailer_without_num_samples_and_with_no_frames():
    w, data = _piped(np.zeros((K, 0), np.int64))
    r = CodeReader(io.BytesIO(data))
    assert r.read_all().shape == (K, 0)
    assert (r.num_frames, r.num_samples) == (0, None)


def test_seekable_outputs_get_no_trailer():
    buf = io.BytesIO()
    w = CodeWriter(buf, CodeHeader(num_codebooks=K))
    w.write(_codes(3))
    w.close(num_samples=3 * 1920 - 5)
    assert not w.has_trailer
    data = buf.getvalue()
    assert _preamble(data)[2] == 1 and len(data) == 20 + _preamble(data)[4] + 3 * K * 2
    r = CodeReader(io.BytesIO(data))
    assert not r.has_trailer and (r.num_frames, r.num_samples) == (3, 3 * 1920 - 5)


@pytest.mark.parametrize("k", [1, 2, 8, 16, 32])
def test_older_readers_fail_on_a_trailer(k):
    """A reader that ignores flag bit 1 (here: the flag cleared) errors out at the trailer."""
    codes = _codes(4, k=k)
    _, data = _piped(codes, close_with=4 * 1920)
    old_view = bytearray(data)
    old_view[5] &= ~0b10
    with pytest.raises(CodeFileError, match="truncated frame|invalid code"):
        CodeReader(io.BytesIO(bytes(old_view))).read_all()


@pytest.mark.parametrize("cut", [1, 5, 20, 21, 21 + 16, 22])
def test_a_stream_without_its_trailer_is_truncated(cut):
    _, data = _piped(_codes(6), close_with=6 * 1920)
    r = CodeReader(io.BytesIO(data[:-cut]), name="in.mimi")
    with pytest.raises(CodeFileError, match=r"^in\.mimi: truncated \.mimi stream: it ends "
                                            r"without its trailer"):
        r.read_all()
    assert r.num_samples is None


def test_a_trailer_with_the_wrong_count_is_an_error():
    _, data = _piped(_codes(6), close_with=6 * 1920)
    bad = data[:-21] + struct.pack("<4sQQB", b"MEND", 7, 6 * 1920, 0)
    with pytest.raises(CodeFileError, match="trailer: it counts 7 frames, the stream holds 6"):
        CodeReader(io.BytesIO(bad)).read_all()


def test_writer_leaves_the_trailer_out_after_an_error():
    out = PipeLike()
    with pytest.raises(RuntimeError):
        with CodeWriter(out, CodeHeader(num_codebooks=K)) as w:
            w.write(_codes(3))
            raise RuntimeError("encoder crashed")
    with pytest.raises(CodeFileError, match="without its trailer"):
        CodeReader(io.BytesIO(out.getvalue())).read_all()


def test_trailer_with_declared_num_frames():
    _, data = _piped(_codes(4), num_frames=4, close_with=4 * 1920 - 1)
    assert _preamble(data)[2] == 0b11
    r = CodeReader(io.BytesIO(data))
    assert r.num_frames == 4
    np.testing.assert_array_equal(r.read_all(), _codes(4))
    assert r.num_samples == 4 * 1920 - 1


def test_trailer_stream_still_streams_through_a_real_pipe():
    """Frames come out while the writer is still writing: only the trailer is held back."""
    n, k = 10, 8  # frames of 16 bytes: 21 bytes of lookahead = the next frame and a bit
    rfd, wfd = os.pipe()
    got_enough = threading.Event()

    def writer():
        with os.fdopen(wfd, "wb", buffering=0) as f:
            w = CodeWriter(f, CodeHeader(num_codebooks=k))
            assert w.has_trailer
            w.write(_codes(n, k=k))
            got_enough.wait(10)  # the reader must get frames before the stream ends
            w.close(num_samples=n * 1920 - 100)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    received = []
    with os.fdopen(rfd, "rb", buffering=0) as f:
        r = CodeReader(f)
        for chunk in r.frames(max_frames=1):
            received.append(chunk)
            if len(received) == n - 2:  # all but what the 21-byte lookahead holds back
                assert not got_enough.is_set()
                got_enough.set()
    t.join(5)
    assert got_enough.is_set() and len(received) == n
    np.testing.assert_array_equal(np.concatenate(received, axis=1), _codes(n, k=k))
    assert r.num_samples == n * 1920 - 100


# --- error messages name the input -------------------------------------------------------


def test_errors_name_the_input(tmp_path):
    data = _mimi_bytes(_codes(3))[:-3]
    r = CodeReader(io.BytesIO(data), name="x.mimi")
    with pytest.raises(CodeFileError, match=r"^x\.mimi: truncated frame at the end of the file"):
        r.read_all()
    with pytest.raises(CodeFileError, match=r"^stdin: not a \.mimi code file"):
        CodeReader(io.BytesIO(b"RIFFxxxxWAVE" * 3), name="stdin")
    with pytest.raises(CodeFileError, match=r"^x\.mimi: num_codebooks must be"):
        meta = CodeHeader(num_codebooks=K).to_dict()
        meta["num_codebooks"] = 0
        CodeReader(io.BytesIO(_with_json(meta)), name="x.mimi")
    path = tmp_path / "file.mimi"
    path.write_bytes(data)
    with open(path, "rb") as f:  # the default: the file object's own name
        with pytest.raises(CodeFileError, match=f"^{path}: truncated frame"):
            CodeReader(f).read_all()
    with pytest.raises(CodeFileError, match=r"^input: truncated frame"):
        CodeReader(io.BytesIO(data)).read_all()
    bad = bytearray(_mimi_bytes(np.zeros((K, 2), np.int64)))
    struct.pack_into("<H", bad, 20 + _preamble(bad)[4], 4000)
    with pytest.raises(CodeFileError, match=r"^y\.mimi: invalid code 4000"):
        CodeReader(io.BytesIO(bytes(bad)), name="y.mimi").read_all()


def test_npy_errors_name_the_input():
    with pytest.raises(CodeFileError, match=r"^c\.npy: not a valid \.npy code file"):
        load_npy(io.BytesIO(b"not an npy file at all"), name="c.npy")
    with pytest.raises(CodeFileError, match=r"^stdin: invalid \.npy codes: .*must be integers"):
        load_npy(io.BytesIO(_npy(np.zeros((8, 4), np.float32))), name="stdin")
    with pytest.raises(CodeFileError, match=r"^input: not a valid \.npy"):
        load_npy(io.BytesIO(b"junk"))
