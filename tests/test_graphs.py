"""CUDA graphs replay exactly what the eager code computes.

On the CPU, through tests/replay.py's ReplayDouble (a replay emulated: the captured step runs
at every call and fails on any host-side state it changes, any host sync, any operation a
replay would not repeat): the golden conversations, priming, joins into reused rows and
leaves run "graphed" and equal eager. With CUDA, the real graphs (skipped without it: the
only test allowed to skip).
"""

from __future__ import annotations

from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch

from personaplex_cli.core.generator import FrameGenerator
from personaplex_cli.core.graphs import GraphedFrameGenerator, make_generator, use_graphs
from personaplex_cli.core.priming import PersonaTokens
from personaplex_cli.core.sampling import Sampling
from personaplex_cli.model.load import load_lm, load_mimi
from personaplex_cli.model.model import Model
from personaplex_cli.prompts.persona import PersonaPrompt
from personaplex_cli.runtime.scheduler import Scheduler
from replay import HostStateChanged, ReplayDouble, emulate_graphs

GOLDEN = Path(__file__).parent / "data" / "golden"
ASSETS = GOLDEN / "assets"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dir(golden_dir):
    return golden_dir


def test_cpu_generators_are_eager(model_dir):
    lm = load_lm(model_dir, torch.device("cpu"), torch.float32)
    assert type(make_generator(lm)) is FrameGenerator
    assert not use_graphs(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA"):
        GraphedFrameGenerator(lm)
    with pytest.raises(ValueError, match="CUDA"):
        use_graphs(torch.device("cpu"), True)


def _conversation(slots: Scheduler, frames: int) -> torch.Tensor:
    """Two streams, the second joining at frame 10 with other sampling, the first leaving
    at frame 20 and a third taking its row: every row's output, frame by frame."""
    device = slots.session.device
    persona = PersonaPrompt([5, 9, 6, 10, 286, 109], key="p")
    rng = lambda seed: torch.Generator(device).manual_seed(seed).get_state()  # noqa: E731
    first = slots.join(persona, Sampling(), rng(1234))
    pcm = np.load(ASSETS / "input_pcm.npy")[0, :frames * 1920]
    outputs = []
    for t in range(frames):
        if t == 10:
            slots.join(persona, Sampling(top_k_text=5, temp_audio=0.6), rng(99))
        if t == 20:
            slots.leave(first)
            slots.join(PersonaPrompt([7, 8]), Sampling(greedy=True), rng(5))
        frame = np.broadcast_to(pcm[t * 1920:(t + 1) * 1920], (slots.capacity, 1920))
        out = slots.step(frame)
        outputs.append(torch.cat([torch.from_numpy(out.pcm), torch.from_numpy(out.tokens)
                                  .float()], dim=1))
    return torch.stack(outputs)


@needs_cuda
@pytest.mark.parametrize("index", [0, -1], ids=["cuda:0", "last GPU"])
def test_graph_replay_equals_eager(model_dir, index):
    """Rows joining and leaving a captured batch, on the first GPU and on the last (with two
    or more, cuda:1 while cuda:0 is current): the graphs are never captured again and
    replay what the eager code computes (fp32: tokens equal, audio to 1e-4, as on the CPU
    below)."""
    device = torch.device("cuda", index % torch.cuda.device_count())
    lm = load_lm(model_dir, device, torch.float32, dep_steps=8)
    mimi, _ = load_mimi(model_dir, device)
    runs = []
    for graphs in (False, True):
        slots = Scheduler.for_model(SimpleNamespace(mimi=mimi, lm=lm), 3, graphs=graphs)
        captured = dict(getattr(slots.session.gen, "_graphs", {}))
        runs.append(_conversation(slots, frames=30))
        assert dict(getattr(slots.session.gen, "_graphs", {})) == captured
    assert torch.equal(runs[0][..., 1920:], runs[1][..., 1920:])
    assert (runs[0][..., :1920] - runs[1][..., :1920]).abs().max() <= 1e-4


# -- CUDA graphs emulated on the CPU (tests/replay.py) ----------------------------------------

@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from more on a busy machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def graphs_on_cpu(monkeypatch, one_thread):
    emulate_graphs(monkeypatch)


def _model(model_dir, dtype, dep_steps=8) -> Model:
    return Model(model_dir, torch.device("cpu"), dtype, dep_steps=dep_steps)


@pytest.mark.parametrize("case", ["fp32_wav_greedy", "fp32_none_sampled"])
def test_a_graphed_reply_is_nvidias_golden_conversation(model_dir, case, graphs_on_cpu):
    """Priming (a voice recording's, or none) and the question, as reply runs them, through
    the graphs: the golden tokens of NVIDIA's code (eager matches them: test_golden.py)."""
    from personaplex_cli.audio.frames import InputFrames
    from personaplex_cli.audio.io import open_audio
    from personaplex_cli.model.tokenizer import DEFAULT_ROLE
    from personaplex_cli.prompts.persona import Persona, prepare_persona
    from personaplex_cli.prompts.voices import Voice
    from personaplex_cli.runtime.rows import ReplyRequest

    model = _model(model_dir, torch.float32, dep_steps=16)  # 16: the sampled draws' count
    voice = Voice("voice", ASSETS / "voice_prompt.wav", "file") if "_wav_" in case else None
    prompt = prepare_persona(model, Persona(voice, DEFAULT_ROLE))
    greedy = "greedy" in case
    state = None if greedy else torch.from_numpy(
        np.load(GOLDEN / case / "rng_state_before_priming.npy"))
    scheduler = Scheduler.for_model(model, 1, graphs=True)
    scheduler.attend_over_whole_windows()  # as reply's
    captured = ReplayDouble.captures
    tokens = []
    with open_audio(str(ASSETS / "input.wav")) as reader:
        request = ReplyRequest(case, InputFrames(reader), prompt, Sampling(greedy=greedy), state)
        for made, _, _ in scheduler.answer([request]):
            tokens += [frame.tokens for _, frame in made]
    assert ReplayDouble.captures == captured  # never captured again
    assert np.array_equal(np.stack(tokens, 1), np.load(GOLDEN / case / "tokens.npy"))


def _persona(*tokens: int, key=None) -> PersonaPrompt:
    return PersonaPrompt.of_tokens(PersonaTokens(tokens), key=key)


def _primed(model, graphs: bool):
    slots = Scheduler.for_model(model, 2, graphs=graphs)
    slots.join(_persona(5, 9, 6, 10, 286, 109, key="p"), Sampling(greedy=True), 0)
    return slots.priming._cache["p"].saved


def test_a_persona_primed_with_graphs_keeps_what_eager_keeps(model_dir, graphs_on_cpu):
    """What priming leaves (positions, KV history, token ring), saved for the joins: the
    same with graphs as without, slot for slot (the KV rings filled from slot 0 up)."""
    model = _model(model_dir, torch.bfloat16)
    eager, graphed = _primed(model, False), _primed(model, True)
    eager_kv = [saved for saved in eager[3] if len(saved) == 2 and saved[0].dim() == 3]
    assert eager_kv and eager_kv[0][0].shape[1] == 17  # 18 priming frames; the first runs none
    flat = lambda saved: [t for t in torch.utils._pytree.tree_leaves(saved)  # noqa: E731
                          if isinstance(t, torch.Tensor)]
    assert eager[0] == graphed[0]
    assert all(torch.equal(a, b) for a, b in zip(flat(eager), flat(graphed), strict=True))


def _newcomer(model, graphs: bool, occupant_frames: int) -> torch.Tensor:
    """A newcomer's 12 frames (tokens and audio) in row 0 of a batch of 2, after an
    occupant talked there for `occupant_frames` frames and left (0: a fresh engine)."""
    slots = Scheduler.for_model(model, 2, graphs=graphs, cached_personas=0)
    noise = lambda frames, seed: 0.1 * torch.randn(  # noqa: E731
        frames, 1920, generator=torch.Generator().manual_seed(seed))
    if occupant_frames:
        row = slots.join(_persona(7, 8, 9), Sampling(), 11)
        for pcm in noise(occupant_frames, 4):
            slots.step(pcm.expand(2, -1).numpy())
        slots.leave(row)
    row = slots.join(_persona(5, 9, 6, 10), Sampling(), 12)
    assert row == 0
    out = []
    for pcm in noise(12, 3):
        frame = slots.step(pcm.expand(2, -1).numpy())
        out.append(torch.cat([torch.from_numpy(frame.pcm[0]),
                              torch.from_numpy(frame.tokens[0]).float()]))
    return torch.stack(out)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_newcomer_in_a_reused_row_sees_nothing_of_its_last_occupant(model_dir, graphs,
                                                                      graphs_on_cpu):
    """Bit for bit a newcomer in a fresh engine, though the occupant wrapped every ring of
    the row (70 frames: the LM's context is 64, Mimi's 40 steps) and of the primer's."""
    model = _model(model_dir, torch.bfloat16)
    assert torch.equal(_newcomer(model, graphs, 70), _newcomer(model, graphs, 0))


def test_joins_and_leaves_replay_what_eager_computes(model_dir, graphs_on_cpu):
    """The three-row conversation of the CUDA test below, graphs emulated: a step replays
    the smallest captured batch covering the live rows, and equals eager. In fp32, where
    eager attends over the written slots only (a rounding apart: audio to 1e-4), and ties
    in the top-k, which the graphs' wider noise buffers may order otherwise, do not come."""
    model = _model(model_dir, torch.float32)
    runs = []
    for graphs in (False, True):
        slots = Scheduler.for_model(model, 3, graphs=graphs)
        captured, replayed = ReplayDouble.captures, ReplayDouble.replays
        runs.append(_conversation(slots, frames=30))
        assert ReplayDouble.captures == captured
        assert (ReplayDouble.replays > replayed) == graphs
    assert slots.session.buckets == (1, 2, 3)
    assert sorted(slots.session._prefixes) == [1, 2]  # 1 then 2 rows up to the last live
    assert torch.equal(runs[0][..., 1920:], runs[1][..., 1920:])
    assert (runs[0][..., :1920] - runs[1][..., :1920]).abs().max() <= 1e-4


def test_the_double_refuses_a_step_that_moves_host_state(graphs_on_cpu):
    """The emulation is strict: a step that moves a host counter (what WindowState.written
    did) cannot be captured."""
    counter = np.zeros(1, np.int64)

    def step(x):
        counter[0] += 1
        return x + 1

    with pytest.raises(HostStateChanged, match="host-side state"):
        ReplayDouble(step, [torch.zeros(2)], [])


def test_the_double_lets_the_warm_up_build_constants_but_not_change_the_step(graphs_on_cpu):
    """A constant a module makes on the first call and reuses after (the LM's depformer ring
    slots and masks) is captured as CUDA captures it, after the warm-up; a step whose
    operations still change from call to call is refused."""
    from replay import NotReplayable

    holder = torch.nn.Module()
    holder.made = {}

    def lazy(x):
        if "one" not in holder.made:
            holder.made["one"] = torch.ones(2)
        return x + holder.made["one"]

    graphed = ReplayDouble(lazy, [torch.zeros(2)], [])
    with torch.inference_mode():
        assert torch.equal(graphed(torch.zeros(2)), torch.ones(2))
    holder.calls = 0  # a module's attribute: the host-state check does not see it

    def alternating(x):
        holder.calls += 1
        return x * 2 if holder.calls % 2 else x + 1

    with pytest.raises(NotReplayable):
        ReplayDouble(alternating, [torch.zeros(2)], [])


# -- a mocked torch.cuda at an H200's size (tests/fake_cuda.py) -------------------------------

def test_captures_run_on_the_models_device_and_hold_what_the_count_says(monkeypatch):
    """serve's default batch on an H200 (as many sessions as its 139 GiB free hold, at most
    64) of the 7B, whose tensors the meta device holds for cuda:1 while cuda:0 is current:
    every warm-up, capture and replay runs on cuda:1, making a graph copies nothing, and the
    graphs' memory (the pool's peak, the inputs and outputs they keep, their noise buffers)
    is within model/memory.py's count, which fits the H200 with the rows' KV."""
    from dataclasses import replace

    from fake_cuda import FakeCuda
    from personaplex_cli.core import graphs
    from personaplex_cli.core.config import Arch
    from personaplex_cli.core.lm import LMModel
    from personaplex_cli.core.mimi import Mimi
    from personaplex_cli.model.memory import default_dep_steps, memory_need, sessions_that_fit
    from personaplex_cli.runtime.limits import MOST_SESSIONS

    monkeypatch.setattr(graphs, "CAPTURE_WARMUP", 0)  # the same step again: no other peak
    cuda = FakeCuda().install(monkeypatch)
    arch = Arch()
    dep_steps = default_dep_steps(arch.lm)
    one = memory_need(arch, arch.lm, dep_steps, torch.device("cuda"), torch.bfloat16, "none")
    capacity = min(MOST_SESSIONS, sessions_that_fit(one, cuda.free_bytes))
    need = replace(one, streams=capacity)
    assert capacity == 64 and need.total <= cuda.free_bytes
    with torch.device("meta"):
        lm = LMModel(arch.lm, dep_steps, torch.bfloat16).to(torch.bfloat16)
        mimi = Mimi(arch.mimi)
    mimi.prepare()
    model = SimpleNamespace(mimi=mimi, lm=lm)
    with cuda.counting():
        eager = Scheduler.for_model(model, capacity, graphs=False)
        held_eager = cuda.live()
    del eager
    assert held_eager <= (need.streams + need.primer) * need.kv_per_stream
    with cuda.counting():
        slots = Scheduler.for_model(model, capacity, graphs=True)
        held = cuda.live()
    assert slots.session.graphs and slots.session.buckets == (1, 2, 4, 8, 16, 32, 64)
    assert len(cuda.captures) == 4 * 7 + 2 * 3  # the batch's and the primer's live counts
    assert {(c.current, c.stream) for c in cuda.captures} == {(cuda.model_device,) * 2}
    encode, gen, _ = slots.session._first_rows(8)  # 8 live rows' graphs
    encode(torch.zeros(8, 1, 1920, device="meta"))
    gen._temporal(torch.zeros(8, 1, lm.dim, device="meta", dtype=lm.dtype))
    assert cuda.replays == [cuda.model_device] * 2
    pool = max(capture.transient for capture in cuda.captures)
    assert max(made.transient for made in cuda.graphs_made) <= pool  # no copy of a state
    assert held - held_eager + pool <= need.graphs


# -- --graphs auto|on|off ---------------------------------------------------------------------

class CaptureFails(ReplayDouble):
    """A device that refuses every capture, as one out of memory would."""

    def _capture(self, fn, pool, warmup):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_auto_falls_back_to_eager_saying_why_once_and_on_stops(golden_model, monkeypatch,
                                                               one_thread, speech_wav,
                                                               tmp_path):
    """auto: a capture that fails leaves the scheduler eager, and the runtime's entry says
    why in one warning line (reply's run then answers eager); on: the failure stands,
    exit 5."""
    from personaplex_cli import batch
    from personaplex_cli.cli.errors import exit_status
    from personaplex_cli.core import graphs
    from personaplex_cli.errors import EXIT_DEVICE
    from personaplex_cli.model.tokenizer import DEFAULT_ROLE
    from personaplex_cli.runtime import open as open_runtime
    from personaplex_cli.runtime.personas import Personas
    from personaplex_cli.runtime.scheduler import Pacing

    monkeypatch.setattr(graphs, "Graphed", CaptureFails)
    slots = Scheduler.for_model(golden_model, 2)  # auto: where graphs can be captured
    assert not slots.session.graphs and not slots.session.buckets
    assert slots.graphs_fallback.startswith("CUDA graphs could not be captured (CUDA out of "
                                            "memory. Tried to allocate 2.00 GiB)")
    with pytest.raises(graphs.CaptureError) as failed:
        Scheduler.for_model(golden_model, 2, graphs=True)
    assert exit_status(failed.value) == EXIT_DEVICE
    # reply's runtime says it once, and answers eager
    warnings = []
    scheduler = open_runtime(golden_model, None, 2, Pacing.FREE, warn=warnings.append)
    jobs = [batch.Job(0, str(speech_wav), str(tmp_path / "a.wav"), role=DEFAULT_ROLE, seed=1)]
    batch.run(scheduler, jobs, Personas(golden_model), Sampling(), rate=24000,
              sample_formats={jobs[0].audio: "s16"}, keep_going=False,
              warn=warnings.append, on_done=lambda done: None, on_failed=lambda f: None)
    assert (tmp_path / "a.wav").exists()
    assert [line[:33] for line in warnings] == ["CUDA graphs could not be captured"]


def test_the_models_graphs_choice_reaches_its_engines(golden_model, graphs_on_cpu):
    """--graphs, carried by the Model, decides the engine runtime.open makes for it."""
    from personaplex_cli.runtime import open as open_runtime
    from personaplex_cli.runtime.scheduler import Pacing

    auto, off = Model(golden_model.files, golden_model.device, torch.float32), Model(
        golden_model.files, golden_model.device, torch.float32, graphs=False)
    assert open_runtime(auto, None, 2, Pacing.FREE).step_buckets == (1, 2)
    assert open_runtime(off, None, 2, Pacing.FREE).step_buckets is None


def test_graphs_on_is_refused_without_cuda_before_loading(run_cli, tmp_path, speech_wav):
    from conftest import golden_model_folder

    folder = golden_model_folder(tmp_path / "model")
    for args in (("reply", speech_wav, tmp_path / "out.wav"), ("doctor", "--bench"),
                 ("serve", "--port", "0")):
        proc = run_cli(*args, "--graphs", "on", "--device", "cpu",
                       env={"PERSONAPLEX_MODEL": folder})
        assert proc.returncode == 5, proc.stderr
        assert proc.stderr.decode().strip() == ("personaplex: error: --graphs on needs a CUDA "
                                                "device, not the cpu: use --graphs auto or off")
    assert not (tmp_path / "out.wav").exists()


def test_every_out_of_memory_hint_names_options_its_command_has():
    import re

    import typer

    from personaplex_cli.cli import errors
    from personaplex_cli.cli.app import app

    group = typer.main.get_command(app)
    assert set(errors.OUT_OF_MEMORY_HINTS) >= {"reply", "talk", "serve", "doctor"}
    for name, hint in errors.OUT_OF_MEMORY_HINTS.items():
        command = group.commands[name]
        commands = [command, *getattr(command, "commands", {}).values()]
        options = {opt for c in commands for param in c.params for opt in param.opts}
        named = set(re.findall(r"--[a-z][a-z-]*", hint))
        assert named and named <= options, (name, named - options)

    class OutOfMemoryError(RuntimeError):
        pass

    for name in ("serve", "doctor"):
        errors.COMMAND = name
        try:
            assert errors.exit_status(OutOfMemoryError("CUDA out of memory")) == 5
        finally:
            errors.COMMAND = None


def test_the_primers_step_is_timed_to_when_a_gpu_ends_it(golden_model, monkeypatch):
    """On CUDA a step is queued and returns before it ends: --max-prime-s's cost per
    priming frame is timed to a synchronize after the last step (it was not: low)."""
    events = []
    slots = Scheduler.for_model(golden_model, 2, graphs=False)
    monkeypatch.setattr(slots.session, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    primer = slots.priming.primer
    step = primer.step
    monkeypatch.setattr(primer, "step", lambda: (events.append("step"), step())[1])
    slots.priming.time_step(PersonaTokens((5, 9, 6, 10)), steps=3)
    assert events == ["step", "sync", "step", "step", "step", "sync"]
