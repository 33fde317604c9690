"""The runtime's decisions: a step costs the live rows, not the capacity; one warm-up decides
torch's thread count and how many rows keep real time, from injected step timings (no
wall-clock thresholds); serve, talk and reply take that one decision."""

from __future__ import annotations

import numpy as np
import pytest

from personaplex_cli.prompts.persona import Persona, prepare_persona
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.runtime.scheduler import Scheduler


@pytest.fixture(scope="module")
def prompt(golden_model):
    return prepare_persona(golden_model, Persona(None, "Be brief."))


def batch_sizes_stepped(model, monkeypatch) -> list[int]:
    """Records the batch of every temporal step the LM runs."""
    seen: list[int] = []
    forward = model.lm.forward_embeddings

    def counting(x, state):
        seen.append(x.shape[0])
        return forward(x, state)

    monkeypatch.setattr(model.lm, "forward_embeddings", counting)
    return seen


def test_a_step_costs_the_rows_up_to_the_last_live_one(golden_model, prompt, monkeypatch):
    slots = Scheduler.for_model(golden_model, 16, cached_personas=4)
    first = slots.join(prompt, Sampling(), 1)
    second = slots.join(prompt, Sampling(), 2)
    assert (first, second) == (0, 1)  # a join takes the lowest free row
    seen = batch_sizes_stepped(golden_model, monkeypatch)
    slots.step()
    slots.leave(first)
    slots.step()  # row 1 is live still: rows 0 and 1 step
    slots.leave(second)
    third = slots.join(prompt, Sampling(), 3)
    assert third == 0
    slots.step()
    assert seen == [2, 2, 1]


def test_rows_past_the_prefix_keep_their_state_and_answer_zeros(golden_model, prompt):
    """A stream stepped in a prefix of a wide batch equals itself in a batch of its size."""
    pcm = (np.random.default_rng(5).standard_normal((6, 8, 1920)) * 0.1).astype(np.float32)
    wide = Scheduler.for_model(golden_model, 8, cached_personas=0)
    narrow = Scheduler.for_model(golden_model, 2, cached_personas=0)
    for slots in (wide, narrow):
        slots.join(prompt, Sampling(), 11)
        slots.join(prompt, Sampling(), 12)
    for t in range(6):
        a, b = wide.step(pcm[t]), narrow.step(pcm[t, :2])
        assert np.array_equal(a.tokens[:2], b.tokens)
        np.testing.assert_allclose(a.pcm[:2], b.pcm, atol=1e-5)
        assert not a.pcm[2:].any() and not a.tokens[2:].any()


# -- the warm-up's decisions, from injected step timings ------------------------------------

from personaplex_cli.runtime import warmup  # noqa: E402
from personaplex_cli.runtime.warmup import (Capacity, StepTimes, Threads,  # noqa: E402
                                            choose_threads, decide_threads, real_time_rows,
                                            sweep_rows, thread_candidates, time_steps)


class FakeMachine:
    """A clock that a step moves on by what the current thread count and live rows cost."""

    def __init__(self, cost_ms):
        self.now = 0.0
        self.threads = 4
        self.cost_ms = cost_ms  # (threads, rows) -> ms of one step
        self.rows = 1
        self.set_calls: list[int] = []

    def clock(self) -> float:
        return self.now

    def set_threads(self, count: int) -> None:
        self.threads = count
        self.set_calls.append(count)

    def step(self, pcm) -> None:
        self.now += self.cost_ms(self.threads, self.rows) / 1000.0


def test_thread_candidates_go_by_powers_of_two_to_the_cores():
    assert thread_candidates(1) == [1]
    assert thread_candidates(2) == [1, 2]
    assert thread_candidates(6) == [1, 2, 4, 6]


def test_the_fastest_thread_count_is_kept_and_applied():
    """As measured on the 2-core VM: 8 ms a step on 1 thread, 230 ms on torch's default 2."""
    machine = FakeMachine(lambda threads, rows: {1: 8.0, 2: 230.0}[threads])
    threads = decide_threads(machine.step, "cpu", environ={}, cores=2,
                             set_threads=machine.set_threads, clock=machine.clock)
    assert threads.count == 1 and machine.threads == 1
    assert threads.tried_ms == pytest.approx({1: 8.0, 2: 230.0})
    assert "1 torch thread (the fastest step: 8 ms on 1, 230 ms on 2)" == threads.text()


def test_the_thread_count_is_measured_once_per_machine_and_remembered(tmp_path):
    """The first decision measures and is kept under the cache dir; the next (reply, talk,
    serve, another day) takes it without stepping, so seeded bytes never follow a timing.
    Another key (core count, dtype, model) measures afresh; OMP_NUM_THREADS still wins."""
    from personaplex_cli.runtime.warmup import ThreadsMemory, apply_remembered

    memory = ThreadsMemory.of(tmp_path, "cpu", "torch.float32", "none", "abc", cores=2)
    machine = FakeMachine(lambda threads, rows: {1: 8.0, 2: 230.0}[threads])
    first = decide_threads(machine.step, "cpu", environ={}, cores=2, memory=memory,
                           set_threads=machine.set_threads, clock=machine.clock)
    assert first.count == 1 and (tmp_path / "threads.json").exists()
    steps_taken = machine.now
    machine.threads = 4
    again = decide_threads(machine.step, "cpu", environ={}, cores=2, memory=memory,
                           set_threads=machine.set_threads, clock=machine.clock)
    assert machine.now == steps_taken and machine.threads == 1  # not stepped, applied
    assert again.count == 1 and again.tried_ms == pytest.approx(first.tried_ms)
    assert again.text() == "1 torch thread (measured once on this machine)"
    applied: list[int] = []
    assert apply_remembered(memory, "cpu", environ={}, set_threads=applied.append) == again
    assert applied == [1]
    pinned = apply_remembered(memory, "cpu", environ={"OMP_NUM_THREADS": "2"},
                              set_threads=applied.append)
    assert applied == [1] and pinned.given == "OMP_NUM_THREADS as set"
    other = ThreadsMemory.of(tmp_path, "cpu", "torch.float32", "none", "abc", cores=4)
    assert other.recall() is None and memory.recall() is not None
    (tmp_path / "threads.json").write_text("not json")
    assert memory.recall() is None  # a damaged cache is measured again, not fatal
    unmeasured = apply_remembered(memory, "cpu", environ={}, set_threads=applied.append)
    assert applied == [1] and "not measured" in unmeasured.text()  # torch's own, said so


def test_more_threads_are_kept_only_when_clearly_faster():
    assert choose_threads(lambda n: {1: 40.0, 2: 38.0, 4: 37.0}[n], [1, 2, 4]).count == 1
    assert choose_threads(lambda n: {1: 40.0, 2: 21.0, 4: 20.0}[n], [1, 2, 4]).count == 2


def test_the_rounds_interleave_the_candidates():
    """A load that comes and goes falls on every candidate alike: each round tries each."""
    order: list[int] = []
    choose_threads(lambda n: order.append(n) or 10.0, [1, 2], rounds=3)
    assert order == [1, 2, 1, 2, 1, 2]


def test_the_environment_and_gpus_keep_their_threads():
    machine = FakeMachine(lambda threads, rows: 10.0)
    given = decide_threads(machine.step, "cpu", environ={"OMP_NUM_THREADS": "1"}, cores=8,
                           set_threads=machine.set_threads, clock=machine.clock)
    assert given.given == "OMP_NUM_THREADS as set" and machine.set_calls == []
    assert decide_threads(machine.step, "cuda", environ={}, cores=8,
                          set_threads=machine.set_threads).given is not None
    assert machine.set_calls == []
    fixed = decide_threads(machine.step, "cpu", environ={}, fixed=3,
                           set_threads=machine.set_threads)
    assert fixed.count == 3 and machine.set_calls == [3]


def test_rows_in_real_time_from_the_sweep():
    """A step keeps real time within 70% of the 80 ms frame (56 ms)."""
    measured = sweep_rows(lambda rows: 10.0 * rows, 64)
    assert measured == {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}  # stops over 56 ms
    assert real_time_rows(measured) == 4 + int(16 / 40 * 4)
    assert real_time_rows({1: 30.0, 2: 50.0, 4: 110.0}, budget_ms=80.0) == 2 + int(30 / 60 * 2)
    assert real_time_rows({1: 60.0}) == 0
    assert sweep_rows(lambda rows: 1.0, 6) == {1: 1.0, 2: 1.0, 4: 1.0, 6: 1.0}
    # With CUDA graphs, 3 live rows replay the 4-row graph: 110 ms, over the budget.
    assert real_time_rows({1: 30.0, 2: 50.0, 4: 110.0}, 80.0, buckets=(1, 2, 4)) == 2


def capacity(step_ms, fits, asked=None) -> Capacity:
    return Capacity("cpu", Threads(1), step_ms, fits, asked)


def test_the_default_capacity_is_the_smaller_of_memory_and_real_time():
    # The case of issue 20's item 12: 64 slots by memory, where few keep real time.
    by_time = capacity({1: 20.0, 2: 40.0, 4: 72.0}, fits=64)
    assert by_time.rows == 3 and by_time.bound.startswith("bound by real time")
    assert by_time.warning() is None
    by_memory = capacity({1: 5.0, 2: 6.0, 4: 8.0}, fits=4)
    assert by_memory.rows == 4 and by_memory.bound.startswith("bound by memory")
    too_slow = capacity({1: 300.0}, fits=64)
    assert too_slow.rows == 1 and "no caller keeps real time" in too_slow.bound


def test_asking_for_more_than_real_time_is_allowed_with_a_warning():
    asked = capacity({1: 20.0, 2: 40.0, 4: 72.0}, fits=64, asked=8)
    assert asked.rows == 8 and asked.bound == "as --max-sessions asked"
    assert "--max-sessions 8 is over the 3 callers this device steps in real time" \
        in asked.warning()
    assert capacity({1: 20.0, 2: 40.0}, fits=64, asked=2).warning() is None


def test_the_warm_up_verdict_and_the_sessions_p50_are_one_measure():
    """The serve engine's p50 is the warm-up's StepTimes p50 over the same step times."""
    from personaplex_cli.runtime.stats import StepStats

    costs = [0.012, 0.019, 0.031, 0.015, 0.022, 0.017, 0.090, 0.016]
    machine = FakeMachine(lambda threads, rows: 1000.0 * costs.pop(0))
    warm = time_steps(machine.step, skipped=0, measured=8, clock=machine.clock)
    stats = StepStats()
    stats.step_times.extend([0.012, 0.019, 0.031, 0.015, 0.022, 0.017, 0.090, 0.016])
    assert stats.step_ms(0.5) == pytest.approx(warm.p50_ms)
    assert StepTimes.of(1000.0 * t for t in stats.step_times) == warm


def time_on(machine, slots, monkeypatch) -> None:
    """Each step of `slots` also costs what `machine` says for its live rows."""
    step = slots.step

    def timed_step(pcm=None):
        machine.rows = len(slots.live())
        machine.step(pcm)
        return step(pcm)

    monkeypatch.setattr(slots, "step", timed_step)


def test_serve_warms_up_its_slots_and_keeps_what_holds_real_time(golden_model, prompt,
                                                                 monkeypatch):
    """warm_up_slots on real slots: priming timed, the threads decided on a live row, then
    1, 2, 4 ... live rows each costing 20 ms on the injected clock -> 2 rows keep real
    time (within 56 ms) of the 8 that fit; every row leaves afterwards."""
    slots = Scheduler.for_model(golden_model, 8, cached_personas=2)
    machine = FakeMachine(lambda threads, rows: 20.0 * rows if threads == 1 else 500.0)
    time_on(machine, slots, monkeypatch)
    monkeypatch.setattr(warmup.os, "cpu_count", lambda: 2)
    monkeypatch.setattr("torch.set_num_threads", machine.set_threads)
    result = warmup.warm_up_slots(slots, prompt, Sampling(), "cpu", fits_memory=8,
                                  environ={}, clock=machine.clock)
    assert result.threads.count == 1 and machine.threads == 1
    assert result.step_ms == pytest.approx({1: 20.0, 2: 40.0, 4: 80.0})
    assert result.real_time == 2 and result.rows == 2
    assert slots.live() == [] and slots.free() == 8


def test_with_graphs_the_warm_up_counts_each_live_count_at_its_graphs_cost(
        golden_model, prompt, monkeypatch):
    """Graphed slots (CUDA graphs emulated on the CPU: tests/replay.py) step 3 live rows by
    the 4-row graphs, so the warm-up's sweep over 1, 2, 4 ... measures the captured counts'
    costs, and a count keeps real time up to its own and no further (15 ms a row: 2, where
    interpolating would say 3)."""
    from replay import emulate_graphs

    emulate_graphs(monkeypatch)
    slots = Scheduler.for_model(golden_model, 8, cached_personas=2)
    assert slots.step_buckets == (1, 2, 4, 8)
    machine = FakeMachine(lambda threads, rows: 15.0 * rows)
    time_on(machine, slots, monkeypatch)
    monkeypatch.setattr(warmup.os, "cpu_count", lambda: 1)
    monkeypatch.setattr("torch.set_num_threads", machine.set_threads)
    result = warmup.warm_up_slots(slots, prompt, Sampling(), "cpu", fits_memory=8,
                                  environ={}, clock=machine.clock)
    assert result.step_ms == pytest.approx({1: 15.0, 2: 30.0, 4: 60.0})
    assert result.buckets == (1, 2, 4, 8) and result.real_time == 2
    assert real_time_rows(result.step_ms) == 3


def test_the_serve_engine_catches_up_the_ticks_a_slow_step_cost(monkeypatch):
    """One step stalls for 300 ms (a busy machine): the engine steps the ticks it lost back
    to back, with the frames the caller's queue holds, so a caller's client does not play
    them as silence for good. On the injected clock, 2 s of a call are 25 steps."""
    from types import SimpleNamespace

    from stand_ins import NOBODY, stand_in_scheduler

    from personaplex_cli.runtime import scheduler as engine_module
    from personaplex_cli.runtime.rows import LiveRow
    from personaplex_cli.runtime.scheduler import Callbacks

    clock = SimpleNamespace(now=0.0)
    fake_time = SimpleNamespace(perf_counter=lambda: clock.now,
                                sleep=lambda s: setattr(clock, "now", clock.now + s))
    monkeypatch.setattr(engine_module, "time", fake_time)
    row = LiveRow(NOBODY, None, None)
    calls = SimpleNamespace(steps=0)

    def step(pcm):
        calls.steps += 1
        clock.now += 0.3 if calls.steps == 5 else 0.02
        if clock.now >= 2.0:
            engine._stopping = True
        return SimpleNamespace(pcm=np.zeros((1, 1920), np.float32))

    def feed(batch):  # the caller's frames are there whenever the engine looks
        row.put(np.zeros(1920, np.float32))

    engine = stand_in_scheduler(step, callbacks=Callbacks(frames=feed, live=feed, done=print,
                                                          refused=print, failed=print))
    engine.add(row)
    engine._loop()
    assert calls.steps == 26  # ticks at 0, 0.08, ... 2.0 s: none lost to the stall
    assert engine.stats.overruns >= 3


# -- the one scheduler ------------------------------------------------------------------------

def test_free_pacing_refills_a_row_at_once_and_ends_only_the_failing_one():
    """reply's pacing on the one scheduler: three recordings in two rows; the third takes
    the row of the first the step after it ended; a recording that fails to read ends its
    row alone, with its error; every step and row-frame is in the one StepStats."""
    from types import SimpleNamespace

    from stand_ins import NOBODY, stand_in_scheduler

    from personaplex_cli.errors import InputError
    from personaplex_cli.runtime.rows import ReplyRequest
    from personaplex_cli.runtime.stats import StepStats

    def frames(value: float, count: int, fail_at: int | None = None):
        for i in range(count):
            if i == fail_at:
                raise InputError("the recording is cut short")
            yield np.full(1920, value, np.float32)

    steps = []

    def echo(pcm):  # a step echoes each row's frame back: which row got which frame
        steps.append(pcm.copy())
        return SimpleNamespace(pcm=pcm.copy())

    stats = StepStats()
    scheduler = stand_in_scheduler(echo, 2, stats=stats)
    greedy = Sampling(greedy=True)
    requests = [ReplyRequest("a", frames(1.0, 2), NOBODY, greedy),
                ReplyRequest("b", frames(2.0, 5, fail_at=4), NOBODY, greedy),
                ReplyRequest("c", frames(3.0, 2), NOBODY, greedy)]
    made, finished, failed = [], [], []
    for answered in scheduler.answer(requests):
        made.append([key for key, _ in answered.made])
        finished += answered.finished
        failed += [(key, error.message) for key, error in answered.failed]
    # b's fourth frame is read ahead (to trim its last one) and fails: b stepped 3 times.
    assert made == [["a", "b"], ["a", "b"], ["b", "c"], ["c"], []]
    assert finished == ["a", "c"] and failed == [("b", "the recording is cut short")]
    assert scheduler.free() == 2  # every row left
    assert [step[:, 0].tolist() for step in steps] == \
        [[1.0, 2.0], [1.0, 2.0], [3.0, 2.0], [3.0, 0.0]]
    assert (stats.steps, stats.frames) == (4, 7)


def test_talk_and_serve_read_the_one_step_statistics():
    """talk's live line (LiveLoop.snapshot) is the runtime's StepStats, the object serve's
    /metrics reads: the same percentiles over the same steps."""
    from types import SimpleNamespace

    from stand_ins import stand_in_loop

    from personaplex_cli.live.loop import FreeClock, RecordingCaller
    from personaplex_cli.runtime.stats import StepStats

    class Echo:
        def step(self, pcm):
            return SimpleNamespace(pcm=pcm, pieces=[""])

    engine = stand_in_loop(Echo(), RecordingCaller([np.zeros(1920, np.float32)] * 12,
                                                   FreeClock())).start()
    assert engine.wait(10) and engine.error is None and engine.ended_by_input
    stats = engine.scheduler.stats
    assert isinstance(stats, StepStats) and stats.steps == engine.frames == 12
    look = engine.snapshot(window_s=60.0)
    assert look.compute_p50_ms == stats.step_ms(0.5, 60.0) == stats.step_ms(0.5)
    assert look.compute_p99_ms == stats.step_ms(0.99)
    assert look.session_compute_p50_ms == stats.session_ms(0.5)
    assert look.rtf == pytest.approx(stats.step_ms(0.5) / 80.0)


def test_talk_s_row_is_admitted_primed_and_paced_like_any_other(golden_model, prompt):
    """talk's row goes through the scheduler as every row does: admitted into a slot,
    primed (from the warm-up's cache, so at once), stepped whenever its source gives a
    frame, and out of its slot at the source's end."""
    from personaplex_cli.live.loop import FreeClock, LiveLoop, RecordingCaller
    from personaplex_cli.runtime.rows import RowState, SourceRow

    scheduler = Scheduler.for_model(golden_model, 1)
    scheduler.leave(scheduler.join(prompt, Sampling(), 0))  # the warm-up: persona cached
    primed = scheduler.primer_steps
    row = SourceRow(prompt, Sampling(), 7)
    seen = []
    step = scheduler.step

    def watched(pcm=None):
        seen.append((row.slot, row.state, scheduler.pending_frames()))
        return step(pcm)

    scheduler.step = watched
    frames = (np.random.default_rng(3).standard_normal((6, 1920)) * 0.1).astype(np.float32)
    loop = LiveLoop(scheduler, row, RecordingCaller(list(frames), FreeClock())).start()
    assert loop.wait(60) and loop.error is None and loop.ended_by_input
    assert seen == [(0, RowState.LIVE, 0)] * 6 and loop.frames == 6
    assert row.frames == 6 and row.state is RowState.ENDED and scheduler.free() == 1
    assert scheduler.primer_steps == primed  # its persona was primed once, by the warm-up
