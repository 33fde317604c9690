"""A batch of conversations: Mimi and the frame generator together, one 80 ms frame at a time.

Caller audio [B, 1920] in -> (assistant audio [B, 1920], the frame's 17 tokens [B, 17]) out,
with the model's 80 ms lag: the first frame out is the last primed silence frame. Each row
is a stream of its own (its own position, history, sampling and generator): `reset(rows)`,
`save(row)` and `restore(row, ...)` act on single rows while the others go on. What `step`
returns is a host copy (one device-to-host transfer per frame), never a buffer the next step
overwrites, so another thread may hold on to it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import priming
from .config import ASSISTANT_CODES
from .graphs import GraphedCodecFrames, make_generator, new_pool, use_graphs
from .layers import CONVERSATION_WINDOW, Window, WindowState
from .lm import LMModel
from .mimi import Mimi
from .priming import VoiceEmbeddings
from .sampling import Noise, Sampling
from .streaming import Rows


@torch.inference_mode()
def encode_voice(mimi: Mimi, pcm: torch.Tensor,
                 window: Window = CONVERSATION_WINDOW) -> torch.Tensor:
    """Mimi codes [8, N] of a voice recording [L] (24 kHz), streamed like NVIDIA's code."""
    pcm = F.pad(pcm.float().view(1, 1, -1), (0, -pcm.shape[-1] % mimi.frame_size))
    state = mimi.encoder_state(1, max_frames=pcm.shape[-1] // mimi.frame_size, window=window)
    return mimi.encode(pcm.to(next(mimi.parameters()).device), state)[0]


@torch.inference_mode()
def record_voice_phase(mimi: Mimi, lm: LMModel, pcm: torch.Tensor) -> VoiceEmbeddings:
    """What a .pt voice stores for a (normalised, 24 kHz) voice recording [L]."""
    return priming.record_voice(make_generator(lm, 1, graphs=False), encode_voice(mimi, pcm))


class Session:
    """B rows of Mimi streaming state and one frame generator. With `graphs` (default: on
    CUDA), every per-frame computation replays a CUDA graph, one set per live count
    (core/graphs.py), all in one memory pool (`pool`)."""

    def __init__(self, mimi: Mimi, lm: LMModel, batch: int = 1, *,
                 window: Window = CONVERSATION_WINDOW, graphs: bool | None = None):
        self.mimi = mimi
        self.batch = batch
        self.device = next(lm.parameters()).device
        self.graphs = use_graphs(self.device, graphs)
        self.encoder = mimi.encoder_state(batch, window=window, trim=not self.graphs)
        self.decoder = mimi.decoder_state(batch, window=window, trim=not self.graphs)
        self.pool = new_pool(self.device) if self.graphs else None
        self.gen = make_generator(lm, batch, graphs=self.graphs, window=window, pool=self.pool)
        self._codec = (GraphedCodecFrames(mimi, self.encoder, self.decoder, batch,
                                          pool=self.pool) if self.graphs else None)
        self._prefixes: dict[int, tuple] = {}
        self.predicted: torch.Tensor | None = None  # the last step's (FrameGenerator's)
        # The LM's rule for its windows as made (core.graphs.make_generator's), before any
        # `attend_over_whole_windows`: a primer's rule.
        self._primer_trim = [window.trim for window in self._windows(self.gen.temporal)]

    @property
    def buckets(self) -> tuple[int, ...] | None:
        """The live counts a step's cost steps at (a graph per count, each computing its
        whole batch), or None where a step costs exactly its rows (eager)."""
        return self.gen.buckets if self.graphs else None

    @staticmethod
    def _windows(*states) -> list[WindowState]:
        return [window for state in states for window in state.values()
                if isinstance(window, WindowState)]

    def attend_over_whole_windows(self) -> None:
        """Every attention, Mimi's and the LM's, over its whole KV window from now on, as a
        CUDA graph always attends, rather than over the slots written so far (eager fp32's
        saving, core.layers.WindowState.trim)."""
        for window in self._windows(self.encoder, self.decoder, self.gen.temporal,
                                    self.gen.depth):
            window.trim = False
        self._prefixes.clear()  # their window states are copies, made with the old rule

    @contextlib.contextmanager
    def priming_windows(self):
        """Meanwhile, the LM's windows attend as a side primer's do (core.priming.Primer on
        a generator of its own), for a row that primes in place: its primed state is then
        the primer's, bit for bit, whatever `attend_over_whole_windows` said."""
        windows = self._windows(self.gen.temporal)
        now = [window.trim for window in windows]
        for window, trim in zip(windows, self._primer_trim):
            window.trim = trim
        try:
            yield
        finally:
            for window, trim in zip(windows, now):
                window.trim = trim

    def reset(self, rows: Rows = None) -> None:
        """Those rows (default: all) back to before priming, with the same graphs."""
        self.encoder.reset(rows)
        self.decoder.reset(rows)
        self.gen.reset(rows)

    def start(self, row: int, primed: tuple, sampling: Sampling | None,
              rng: Noise | None) -> None:
        """Row `row` continues a primed stream (`FrameGenerator.save` of a primed row), with
        fresh codec history, sampling by `sampling` from `rng`."""
        self.encoder.reset([row])
        self.decoder.reset([row])
        self.gen.restore(row, primed)
        self.gen.set_sampling(row, sampling, rng)

    def check_sampling(self, sampling: Sampling) -> None:
        """Raises ValueError for sampling this session's noise cannot draw."""
        self.gen.sampling.check(sampling)

    def free(self, row: int) -> None:
        """Row `row` holds no stream: it samples nothing (what it computes is never read)."""
        self.gen.set_sampling(row, None)

    def _first_rows(self, rows: int) -> tuple:
        """(encode, generator, decode) of the first `rows` rows alone, views of this
        session's state (with graphs: that count's own graphs), made once per row count."""
        if rows not in self._prefixes:
            gen = self.gen if rows == self.batch else self.gen.first_rows(rows)
            if self._codec is not None:
                self._prefixes[rows] = self._codec.encode[rows], gen, self._codec.decode[rows]
            else:
                # Closures over the states, never over self: a session in a reference
                # cycle outlives its last reference, holding its KV windows until the
                # collector runs.
                encoder, decoder = self.encoder, self.decoder
                if rows < self.batch:
                    encoder, decoder = encoder.prefix(rows), decoder.prefix(rows)
                mimi = self.mimi
                self._prefixes[rows] = (lambda pcm: mimi.encode(pcm, encoder), gen,
                                        lambda codes: mimi.decode(codes, decoder))
        return self._prefixes[rows]

    @torch.inference_mode()
    def step(self, pcm: torch.Tensor, rows: int | None = None, *,
             agent: torch.Tensor | None = None, text: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """pcm [B, 1920] -> host copies of (assistant pcm [B, 1920] float32, tokens
        [B, 17] int64). With `rows`, only the first `rows` rows step (with graphs, the
        smallest captured batch that covers them); the others keep their state and answer
        zeros. `agent` [B, 8] and `text` [B] force the assistant's tokens of this frame
        (teacher forcing: FrameGenerator.step); `predicted` then holds the model's own."""
        rows = self.batch if rows is None else self.gen.rows_for(rows)
        encode, gen, decode = self._first_rows(rows)
        codes = encode(pcm[:rows].to(self.device, torch.float32).view(rows, 1, -1))
        frame = gen.step(user=codes[:, :, 0], agent=None if agent is None else agent[:rows],
                         text=None if text is None else text[:rows])  # [rows, 17]
        self.predicted = gen.predicted
        if frame is None:
            raise RuntimeError("start a primed stream in the session before stepping it")
        # Rows without a stream may hold start-of-stream tokens, which are no Mimi codes.
        codes = frame[:, ASSISTANT_CODES, None].clamp(0, self.mimi.cardinality - 1)
        audio = decode(codes)[:, 0]  # [rows, 1920]
        # One transfer: token ids < 2^24 are exact in float32.
        both = torch.cat([audio, frame.to(audio.dtype)], dim=1).cpu()
        if rows < self.batch:
            both = torch.cat([both, both.new_zeros(self.batch - rows, both.shape[1])])
        return both[:, :audio.shape[1]], both[:, audio.shape[1]:].long()
