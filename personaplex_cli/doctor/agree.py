"""doctor --bench's agreement check: one seeded tiny model, run three ways (on the CPU, on the
device eager, on the device with CUDA graphs), must give the same tokens, so that the first
GPU that runs us tells its owner whether our path is right, before any 17 GB download.

Each run is the same conversation of two rows, as the runtime's scheduler runs it: a
persona with a voice primed into row 0, the same persona joining row 1 from the cache, the
first leaving and another persona, primed by the primer, taking its row. It is
teacher-forced: every frame's assistant tokens (text and audio codes) are forced from one
seeded sequence, so each frame is predicted from the same history whatever an earlier
frame predicted, and what is compared is each live row's own greedy prediction (text, and
every audio codebook the depformer runs, steered by the forced tokens) and the caller's
codes (Mimi's encoding of the same audio). The first frame, row and stream that differ are
named. The reference run steps every row over whole windows; the others step as the
product does (the rows up to the last live one, or the graphs of the smallest batch
covering them), so on the CPU alone the check still holds the engine's row bookkeeping to
the plain computation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..core.config import FRAME_SIZE
from ..core.priming import PersonaTokens
from ..core.sampling import Sampling
from ..prompts.persona import PersonaPrompt

ROWS = 2
FRAMES = 24
SEED = 3
JOIN_CACHED, REUSED = 6, 12  # frames where the cached join comes, and the reused row's


@dataclass(frozen=True)
class Run:
    """One run's tokens: per frame, each row's predictions and caller codes, and who was
    live."""

    name: str
    tokens: torch.Tensor  # [frames, rows, streams] (predictions, then the caller's codes)
    live: torch.Tensor  # [frames, rows] bool


@dataclass(frozen=True)
class Verdict:
    run: str  # "cuda:0 graphs" ...
    against: str  # the reference run's name
    agree: bool | None  # None: not run
    frame: int | None = None
    row: int | None = None
    stream: str | None = None
    got: int | None = None
    want: int | None = None
    why_not_run: str | None = None

    def line(self) -> str:
        if self.agree is None:
            return f"{self.run}: not run ({self.why_not_run})"
        if self.agree:
            return (f"{self.run} agrees with {self.against} over {FRAMES} teacher-forced "
                    f"frames (a primed persona, a cached join, a join into a reused row)")
        return (f"{self.run} differs from {self.against} from frame {self.frame}, row "
                f"{self.row}, {self.stream}: {self.got} against {self.want}")

    def as_json(self) -> dict:
        return asdict(self)


def stream_names(dep_steps: int, caller: int) -> list[str]:
    return (["the text"] + [f"assistant codebook {k + 1}" for k in range(dep_steps)]
            + [f"caller codebook {k + 1}" for k in range(caller)])


def _inputs(lm, mimi) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """The caller's audio [F, R, 1920], the forced assistant codes [F, R, 8] and text [F, R],
    and two personas, all from SEED."""
    generator = torch.Generator().manual_seed(SEED)
    pcm = 0.1 * torch.randn(FRAMES, ROWS, FRAME_SIZE, generator=generator)
    agent = torch.randint(0, lm.card, (FRAMES, ROWS, lm.n_q // 2), generator=generator)
    text = torch.randint(0, lm.text_card, (FRAMES, ROWS), generator=generator)
    voice = torch.randint(0, lm.card, (mimi.num_codebooks, 4), generator=generator)
    personas = (PersonaPrompt.of_tokens(PersonaTokens((10, 11, 12), voice), key="voiced"),
                PersonaPrompt.of_tokens(PersonaTokens((13, 14))))
    return pcm, agent, text, personas


@torch.inference_mode()
def run(name: str, lm, mimi, graphs: bool, whole: bool) -> Run:
    """The conversation on `lm` and `mimi` (already on their device)."""
    from ..runtime.scheduler import Scheduler
    from .bench import BenchModel, bench_arch

    pcm, agent, text, (voiced, other) = _inputs(lm, mimi)
    model = BenchModel(bench_arch("tiny"), next(lm.parameters()).device, torch.float32,
                       "none", mimi=mimi, lm=lm)
    scheduler = Scheduler.for_model(model, ROWS, graphs=graphs, cached_personas=1)
    if whole:
        scheduler.attend_over_whole_windows()
    greedy = Sampling(greedy=True)
    device = next(lm.parameters()).device
    tokens, live = [], []
    for t in range(FRAMES):
        if t == 0:
            first = scheduler.join(voiced, greedy, 0)
        elif t == JOIN_CACHED:
            scheduler.join(voiced, greedy, 1)
        elif t == REUSED:
            scheduler.leave(first)
            assert scheduler.join(other, greedy, 2) == first
        frame = scheduler.step(pcm[t].numpy(), agent=agent[t].to(device),
                               text=text[t].to(device))
        predicted = scheduler.session.predicted.cpu()
        predicted = torch.cat([predicted, predicted.new_zeros(ROWS - len(predicted),
                                                              predicted.shape[1])])
        caller = torch.from_numpy(frame.tokens[:, -(lm.n_q // 2):])
        tokens.append(torch.cat([predicted, caller], dim=1))
        live.append(torch.tensor([slot in scheduler.live() for slot in range(ROWS)]))
    return Run(name, torch.stack(tokens), torch.stack(live))


def compare(reference: Run, other: Run, dep_steps: int) -> Verdict:
    differ = (reference.tokens != other.tokens) & reference.live[:, :, None]
    if not differ.any():
        return Verdict(other.name, reference.name, True)
    frame, row, stream = (int(i) for i in differ.nonzero()[0])
    names = stream_names(dep_steps, reference.tokens.shape[2] - 1 - dep_steps)
    return Verdict(other.name, reference.name, False, frame, row, names[stream],
                   int(other.tokens[frame, row, stream]),
                   int(reference.tokens[frame, row, stream]))


def three_ways(build, device: torch.device, graphs: bool | None = None) -> list[Verdict]:
    """`build(device)` -> (lm, mimi), the same weights on any device (fp32): the reference
    run on the CPU over whole windows, then the CPU stepping as the product does, or
    `device` eager and with graphs (as --graphs says: off, not run; auto, not run where a
    capture fails; on, that failure raised)."""
    from ..core.graphs import CaptureError, use_graphs

    cpu = torch.device("cpu")
    reference = run("cpu (whole windows)", *build(cpu), graphs=False, whole=True)
    here = build(device)
    verdicts = [compare(reference, run(f"{device} eager", *here, graphs=False, whole=False),
                        here[0].dep_steps)]
    name = f"{device} graphs"
    if graphs is False or not use_graphs(device):
        why = "--graphs off" if graphs is False else "CUDA graphs need a CUDA device"
        return verdicts + [Verdict(name, reference.name, None, why_not_run=why)]
    try:
        graphed = run(name, *here, graphs=True, whole=False)
    except CaptureError as error:
        if graphs:
            raise
        return verdicts + [Verdict(name, reference.name, None,
                                   why_not_run=f"the capture failed: {error}")]
    return verdicts + [compare(reference, graphed, here[0].dep_steps)]


def seeded_tiny(device: torch.device):
    """doctor --bench's tiny model, seeded: the same weights on every device (drawn on the
    CPU, loaded as reply loads a checkpoint), fp32 -> (lm, mimi)."""
    from ..model.load import build_lm
    from ..model.memory import default_dep_steps
    from .bench import bench_arch, random_mimi, random_source

    arch = bench_arch("tiny")
    cpu = torch.device("cpu")
    lm = build_lm(arch.lm, default_dep_steps(arch.lm), device, torch.float32, "none",
                  random_source(arch.lm, cpu, torch.float32, seed=SEED))
    return lm, random_mimi(arch, device, seed=SEED)


def check(device: torch.device, graphs: bool | None = None) -> list[Verdict]:
    return three_ways(seeded_tiny, device, graphs)
