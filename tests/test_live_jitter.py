"""The live path's rings: OutputJitterBuffer (model -> speaker) and InputQueue (mic -> model).

No hardware: the audio callback is played by plain calls, or by a thread for the races.
"""

from __future__ import annotations

import threading
import time
import tracemalloc

import numpy as np
import pytest

from personaplex_cli.live.jitter import InputQueue, OutputJitterBuffer

SR = 24000
F = 1920  # 80 ms


def ramp(start: int, n: int) -> np.ndarray:
    """Samples numbered start+1 .. start+n (float32 holds integers exactly up to 2**24)."""
    return np.arange(start + 1, start + n + 1, dtype=np.float32)


# -- OutputJitterBuffer -------------------------------------------------------------------

def test_frames_come_out_unchanged_in_any_pull_size():
    buf = OutputJitterBuffer(SR, capacity_ms=800)
    for k in range(5):
        buf.push(ramp(k * F, F))
    sizes = [1, 511, 1920, 7, 3000, 2160, 2001]  # 9600 in all
    assert sum(sizes) == 5 * F
    got = np.concatenate([buf.pull(n) for n in sizes])
    np.testing.assert_array_equal(got, ramp(0, 5 * F))
    assert buf.underruns == 0 and buf.depth == 0 and buf.handed_out == 5 * F


def test_underrun_gives_silence_and_is_counted():
    buf = OutputJitterBuffer(SR)
    buf.push(ramp(0, 1000))
    out = buf.pull(F)
    np.testing.assert_array_equal(out[:1000], ramp(0, 1000))
    assert not out[1000:].any()
    assert buf.underruns == 1 and buf.underrun_samples == F - 1000
    assert not buf.pull(F).any()  # still nothing: silence, another underrun
    assert buf.underruns == 2 and buf.underrun_samples == 2 * F - 1000
    buf.push(ramp(1000, F))  # playback resumes with the next push
    np.testing.assert_array_equal(buf.pull(F), ramp(1000, F))
    assert buf.underruns == 2


def test_silence_before_the_first_audio_is_not_an_underrun():
    buf = OutputJitterBuffer(SR)
    for _ in range(3):
        assert not buf.pull(F).any()
    assert buf.underruns == 0 and buf.underrun_samples == 0 and buf.handed_out == 3 * F


def test_full_buffer_drops_the_oldest_and_counts():
    buf = OutputJitterBuffer(SR, capacity_ms=320)  # 4 frames
    assert buf.capacity == 4 * F
    for k in range(6):
        buf.push(ramp(k * F, F))
    assert buf.overruns == 2 and buf.dropped_samples == 2 * F
    assert buf.depth == 4 * F and buf.depth_ms == pytest.approx(320.0)
    np.testing.assert_array_equal(buf.pull(4 * F), ramp(2 * F, 4 * F))
    st = buf.stats()
    assert (st.pushed, st.handed_out, st.overruns, st.dropped_samples) == (6 * F, 4 * F, 2, 2 * F)


def test_partial_overflow_drops_just_enough():
    buf = OutputJitterBuffer(SR, capacity_ms=100)  # 2400 samples
    buf.push(ramp(0, F))
    buf.push(ramp(F, F))  # 3840 > 2400: the oldest 1440 go
    assert buf.dropped_samples == 1440 and buf.overruns == 1
    np.testing.assert_array_equal(buf.pull(2400), ramp(1440, 2400))


def test_a_push_larger_than_the_capacity_keeps_its_tail():
    buf = OutputJitterBuffer(SR, capacity_ms=40)  # 960 samples
    buf.push(ramp(0, 100))
    buf.push(ramp(100, 3000))
    assert buf.dropped_samples == 100 + 3000 - 960
    np.testing.assert_array_equal(buf.pull(960), ramp(3100 - 960, 960))


def test_depth_ms_and_clear():
    buf = OutputJitterBuffer(SR)
    buf.push(np.ones(F, np.float32))
    buf.push(np.ones(F // 2, np.float32))
    assert buf.depth_ms == pytest.approx(120.0)
    buf.clear()
    assert buf.depth == 0 and buf.dropped_samples == 0
    assert not buf.pull(10).any()


def test_prefill_waits_before_starting_and_after_an_underrun():
    buf = OutputJitterBuffer(SR, prefill_ms=160)  # two frames
    buf.push(ramp(0, F))
    assert not buf.pull(F).any() and buf.underruns == 0  # waiting for the prefill
    buf.push(ramp(F, F))
    np.testing.assert_array_equal(buf.pull(F), ramp(0, F))
    np.testing.assert_array_equal(buf.pull(F), ramp(F, F))
    assert not buf.pull(F).any() and buf.underruns == 1  # empty: underrun, refill first
    buf.push(ramp(2 * F, F))
    assert not buf.pull(F).any()  # one frame is below the prefill
    buf.push(ramp(3 * F, F))
    np.testing.assert_array_equal(buf.pull(2 * F), ramp(2 * F, 2 * F))


def test_prefill_cannot_exceed_capacity():
    with pytest.raises(ValueError):
        OutputJitterBuffer(SR, capacity_ms=80, prefill_ms=160)


def test_played_is_exactly_what_was_handed_out():
    buf = OutputJitterBuffer(SR, record_ms=1000)
    handed = []
    buf.push(ramp(0, 1500))
    handed.append(buf.pull(F))  # 1500 samples then 420 of silence
    buf.push(ramp(1500, 2 * F))
    handed.append(buf.pull(700))
    handed.append(buf.pull(F))
    everything = np.concatenate(handed)
    assert buf.handed_out == len(everything)
    np.testing.assert_array_equal(buf.played(0, len(everything)), everything)
    np.testing.assert_array_equal(buf.played(1000, 2000), everything[1000:3000])
    # Beyond what was handed out (the future) reads as silence.
    ahead = buf.played(len(everything) - 100, 300)
    np.testing.assert_array_equal(ahead[:100], everything[-100:])
    assert not ahead[100:].any()


def test_played_forgets_beyond_the_record():
    buf = OutputJitterBuffer(SR, record_ms=100)  # 2400 samples of record
    for k in range(3):
        buf.push(ramp(k * F, F))
        buf.pull(F)
    old = buf.played(0, F)
    assert not old.any()  # positions 0..1919 are older than the last 2400
    recent = buf.played(3 * F - 2400, 2400)
    np.testing.assert_array_equal(recent, ramp(3 * F - 2400, 2400))
    # a pull bigger than the whole record keeps its tail
    buf.push(ramp(3 * F, 5000))
    out = buf.pull(5000)
    np.testing.assert_array_equal(buf.played(3 * F + 5000 - 2400, 2400), out[-2400:])


def test_pull_into_a_callback_style_view():
    buf = OutputJitterBuffer(SR)
    buf.push(ramp(0, F))
    outdata = np.full((F, 1), 7.0, np.float32)  # sounddevice's outdata is [frames, channels]
    buf.pull_into(outdata[:, 0])
    np.testing.assert_array_equal(outdata[:, 0], ramp(0, F))


def test_callback_side_allocates_nothing_big():
    """pull_into and InputQueue.push copy through views into preallocated rings."""
    buf = OutputJitterBuffer(SR)
    q = InputQueue(F, 4, SR)
    frame = ramp(0, F)
    outdata = np.zeros((F, 1), np.float32)
    indata = np.ones((F, 1), np.float32)
    for _ in range(3):  # warm up
        buf.push(frame)
        buf.pull_into(outdata[:, 0])
        q.push(indata[:, 0])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(50):
            buf.pull_into(outdata[:, 0])
            q.push(indata[:, 0])
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 2000, f"the callback path allocated {peak} bytes"  # a frame would be 7680


def test_concurrent_producer_and_callback_keep_order():
    """An inference thread pushes numbered frames at a jittery pace while a 'callback' thread
    pulls odd-sized blocks: every sample played is pushed audio in order or silence, nothing
    is duplicated, and the record matches what the callback got."""
    buf = OutputJitterBuffer(SR, capacity_ms=240, record_ms=60000)
    frames = 150
    rng = np.random.default_rng(0)
    sleeps = rng.uniform(0, 0.002, frames)
    pulled = []
    stop = threading.Event()

    def producer():
        for k in range(frames):
            buf.push(ramp(k * F, F))
            time.sleep(sleeps[k])

    def callback():
        sizes = [480, 1920, 1000, 64, 2500]
        i = 0
        while not stop.is_set():
            pulled.append(buf.pull(sizes[i % len(sizes)]))
            i += 1
            time.sleep(0.0005)

    tc = threading.Thread(target=callback)
    tc.start()
    producer()
    deadline = time.monotonic() + 10
    while buf.depth and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    tc.join()
    got = np.concatenate(pulled)
    audio = got[got != 0]
    assert np.all(np.diff(audio) > 0), "played samples out of order or repeated"
    assert len(audio) + buf.dropped_samples == frames * F
    assert buf.handed_out == len(got)
    np.testing.assert_array_equal(buf.played(0, len(got)), got)


# -- InputQueue ---------------------------------------------------------------------------

def test_blocks_of_any_size_become_frames_with_positions():
    q = InputQueue(F, max_frames=8, sample_rate=SR)
    data = ramp(0, 3 * F + 500)
    for a, b in ((0, 100), (100, 2500), (2500, 2501), (2501, 3 * F + 500)):
        q.push(data[a:b])
    assert q.pending == 3
    for k in range(3):
        frame, pos = q.get_nowait()
        assert pos == k * F
        np.testing.assert_array_equal(frame, data[k * F:(k + 1) * F])
    assert q.get_nowait() is None  # the 500-sample tail is not a frame yet
    q.push(ramp(3 * F + 500, F - 500))
    frame, pos = q.get_nowait()
    assert pos == 3 * F
    np.testing.assert_array_equal(frame, ramp(3 * F, F))


def test_slow_consumer_drops_the_oldest_frames():
    q = InputQueue(F, max_frames=4, sample_rate=SR)
    for k in range(10):
        q.push(ramp(k * F, F))
    assert q.pending == 4 and q.dropped_frames == 6
    assert q.depth_ms == pytest.approx(320.0)
    positions = []
    while (got := q.get_nowait()) is not None:
        frame, pos = got
        np.testing.assert_array_equal(frame, ramp(pos, F))
        positions.append(pos)
    assert positions == [6 * F, 7 * F, 8 * F, 9 * F]
    st = q.stats()
    assert (st.captured, st.frames_taken, st.dropped_frames, st.pending_frames) == (10 * F, 4, 6, 0)


def test_a_block_bigger_than_the_queue():
    q = InputQueue(F, max_frames=2, sample_rate=SR)
    q.push(ramp(0, 100))
    q.push(ramp(100, 5 * F + 300))  # ends at 5*F + 400
    assert q.dropped_frames == 3 and q.pending == 2
    frames = [q.get_nowait() for _ in range(2)]
    assert [p for _, p in frames] == [3 * F, 4 * F]
    for frame, pos in frames:
        np.testing.assert_array_equal(frame, ramp(pos, F))
    q.push(ramp(5 * F + 400, F - 400))
    frame, pos = q.get_nowait()
    assert pos == 5 * F
    np.testing.assert_array_equal(frame, ramp(5 * F, F))


def test_get_waits_for_a_frame_and_times_out():
    q = InputQueue(F, 4, SR)
    t0 = time.monotonic()
    assert q.get(timeout=0.05) is None
    assert 0.04 <= time.monotonic() - t0 < 1.0
    threading.Timer(0.05, q.push, args=(ramp(0, F),)).start()
    got = q.get(timeout=5)
    assert got is not None and got[1] == 0


def test_close_wakes_a_waiting_reader():
    q = InputQueue(F, 4, SR)
    threading.Timer(0.05, q.close).start()
    t0 = time.monotonic()
    assert q.get(timeout=5) is None
    assert time.monotonic() - t0 < 2


def test_clear_keeps_the_partial_frame():
    q = InputQueue(F, 4, SR)
    q.push(ramp(0, 2 * F + 10))
    q.clear()
    assert q.pending == 0 and q.dropped_frames == 0
    q.push(ramp(2 * F + 10, F - 10))
    frame, pos = q.get_nowait()
    assert pos == 2 * F
    np.testing.assert_array_equal(frame, ramp(2 * F, F))


def test_latency_stays_bounded_when_the_engine_is_slow():
    """A real-time 'callback' thread and an engine that needs 1.5 frame times per frame: the
    frames the engine gets are never more than max_frames (+1 in flight) old."""
    period = 0.01  # a 10x faster clock than real life keeps the test short
    q = InputQueue(F, max_frames=3, sample_rate=SR)
    stop = threading.Event()
    written = [0]

    def callback():
        k = 0
        t0 = time.monotonic()
        while not stop.is_set():
            q.push(ramp(k * F, F))
            k += 1
            written[0] = k * F
            time.sleep(max(0.0, t0 + k * period - time.monotonic()))

    t = threading.Thread(target=callback)
    t.start()
    lags = []
    try:
        for _ in range(40):
            got = q.get(timeout=2)
            assert got is not None
            frame, pos = got
            np.testing.assert_array_equal(frame, ramp(pos, F))
            lags.append((written[0] - pos) // F)
            time.sleep(1.5 * period)
    finally:
        stop.set()
        t.join()
    assert q.dropped_frames > 5
    assert max(lags) <= 3 + 2, lags  # max_frames waiting, one being written, scheduling slack
