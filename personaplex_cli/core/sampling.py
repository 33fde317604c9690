"""Token sampling as the reference does it: temperature, top-k, then an exponential race,
with every row of a batch sampling by its own parameters and its own noise.

The race: softmax(logits / temp), the top k probabilities in descending order (not
renormalised), then argmax(p / E) with E ~ Exp(1) drawn per candidate: a multinomial draw
without a host sync. Greedy (or temp <= 0) is the argmax of the raw logits, first index on
ties, and draws nothing. The noise does not depend on the logits, so each frame's is made up
front (`RowSampling.draw`); the sampling itself then is pure tensor work that a CUDA graph
can hold.

Where the noise comes from, per row:
- a key (an int: a seed, or fresh entropy): counter-based noise, a hash of (the row's key,
  its frame offset, the draw, the candidate's rank). One batched computation makes every
  keyed row's noise for the frame, text and every depformer step, whatever the batch size;
  a row's noise depends on its key and its own position alone, so it is the same in any
  batch, in any row, joined at any time, and a primed persona copied from the cache needs
  no generator moved on.
- a torch.Generator (a saved generator state: the reference's own draws, `exponential_`
  from the generator in the order the reference consumes them, text then each depformer
  step): exact to the reference's sampled output, row by row in Python. The golden cases
  check the sampler with it.
"""

from __future__ import annotations

import secrets

import torch

from .config import Sampling  # noqa: F401  (its home is config.py: the CLI reads its defaults)


# A row's source of noise: a key for counter-based noise, or a generator (the reference's).
Noise = int | torch.Generator

_MASK32 = 0xFFFFFFFF
# One round of a 32-bit integer hash (shifts 16, 15, 15 around two multiplies; the constants
# come from Chris Wellons' hash-prospector search, with low bias). Both multipliers are
# below 2**31, so a product of a 32-bit word stays below 2**63: exact in int64 tensors,
# on every device.
_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
_RANK_BITS = 17  # candidate ranks below 2**17 (a vocabulary of up to 131072 entries)
_UNIFORM_BITS = 24  # the hash's top 24 bits: uniforms exact in float32


def _mix(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Hashes x, an int64 tensor of 32-bit words, in place (scratch: a tensor of its shape,
    so that no temporary is allocated) -> x."""
    scratch = torch.empty_like(x) if scratch is None else scratch
    for shift, multiplier in zip((16, 15), _MULTIPLIERS):
        x ^= torch.bitwise_right_shift(x, shift, out=scratch)
        x.mul_(multiplier).bitwise_and_(_MASK32)
    x ^= torch.bitwise_right_shift(x, 15, out=scratch)
    return x


def noise_key(seed: int | None = None) -> int:
    """The key of counter-based noise: a seed's own (the same seed, the same noise), or
    fresh entropy. 64 bits, from the seed's splitmix64 finalizer, so nearby seeds share
    nothing."""
    if seed is None:
        return secrets.randbits(64)
    z = (seed + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return z ^ (z >> 31)


def row_hashes(keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """keys [B, 2] (two 32-bit words each) at frame offsets [B] -> one 32-bit word a row."""
    return _mix(_mix(keys[:, 0] ^ (offsets & _MASK32)) ^ keys[:, 1] ^ (offsets >> 32))


def ranks(draws: int, width: int, device: torch.device, first_draw: int = 0) -> torch.Tensor:
    """[draws, width]: draw d's candidate i as one word (first_draw + d, i)."""
    draw = torch.arange(first_draw, first_draw + draws, device=device)
    return (draw[:, None] << _RANK_BITS) + torch.arange(width, device=device)


def keyed_noise(rows: torch.Tensor, ranks: torch.Tensor, out: torch.Tensor,
                work: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Fills out [B, draws, width] with Exp(1) noise: element (b, d, i) hashes row hash
    rows[b] (row_hashes) with ranks[d, i] -> out. `work`: two int64 tensors of out's shape
    to compute in, so that nothing is allocated (and a CUDA graph can hold it)."""
    bits, scratch = work
    torch.bitwise_xor(rows[:, None, None], ranks, out=bits)
    _mix(bits, scratch)
    bits ^= rows[:, None, None]
    _mix(bits, scratch)
    out.copy_(bits.bitwise_right_shift_(32 - _UNIFORM_BITS))
    return out.add_(0.5).mul_(2.0 ** -_UNIFORM_BITS).log_().neg_()


def make_rng(device: torch.device, seed: int | None = None) -> torch.Generator:
    """A generator on the model's device: seeded, the whole run repeats exactly; unseeded,
    fresh entropy. The global RNG is never used."""
    rng = torch.Generator(device=device)
    if seed is None:
        rng.seed()
    else:
        rng.manual_seed(seed)
    return rng


class RowChoice:
    """What sample_rows reads of the rows' parameters, made once for a frame's draws of one
    kind (the text token, or all the depformer's codebooks: their parameters are the same
    at every step), so each draw does only what depends on its logits."""

    def __init__(self, temp: torch.Tensor, top_k: torch.Tensor, greedy: torch.Tensor,
                 vocab: int, width: int):
        self.greedy = greedy
        # greedy rows divide by 1 (any number would do: their draw is not used), never by 0
        self.temp = torch.where(greedy, torch.ones_like(temp), temp)[:, None]
        take_all = top_k == 0
        # rows without top-k race the tokens in vocabulary order (only when width == vocab)
        self.take_all = take_all[:, None] if width == vocab else None
        self.every_id = torch.arange(vocab, device=temp.device) if width == vocab else None
        count = torch.where(take_all, vocab, top_k)
        self.keep = torch.arange(width, device=temp.device) < count[:, None]

    def sample(self, logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """logits [B, V] (cast to fp32) racing noise [B, width] -> tokens [B]."""
        logits = logits.float()
        probs = torch.softmax(logits / self.temp, dim=-1)
        # the noise's width (the `width` made for), which compiled code keeps symbolic: one
        # compiled draw serves every top-k
        candidates, ids = torch.topk(probs, noise.shape[-1], dim=-1)
        if self.take_all is not None:
            candidates = torch.where(self.take_all, probs, candidates)
            ids = torch.where(self.take_all, self.every_id, ids)
        scores = torch.where(self.keep, candidates / noise, -1.0)
        choice = scores.argmax(dim=-1, keepdim=True)
        sampled = ids.gather(-1, choice)[:, 0]
        return torch.where(self.greedy, logits.argmax(dim=-1), sampled)


def sample_rows(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                greedy: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (cast to fp32) -> tokens [B], row b by temp[b], top_k[b] (0: all V)
    and greedy[b], racing noise[b, :k] (noise [B, K]; K = V when a row takes all)."""
    return RowChoice(temp, top_k, greedy, logits.shape[-1], noise.shape[-1]).sample(logits,
                                                                                  noise)


class RowSampling:
    """The sampling parameters of B rows as device tensors, their sources of noise, and each
    frame's noise.

    `widths` fixes the noise buffers' widths (text, audio), as a CUDA graph needs; then a
    row's top-k may not exceed them. Without it the widths follow the rows' top-k.

    A frame's noise comes in two moves: `draw_generators()` outside any graph (the rows with
    a generator, one by one), then `with_keyed(offsets, text, audio)`, pure tensor work that a
    graph holds (every keyed row at once). `every_frame` (set for a captured graph) makes
    `with_keyed` compute whoever samples; otherwise it skips frames no keyed row samples.
    """

    def __init__(self, batch: int, device: torch.device, vocab: tuple[int, int],
                 dep_steps: int, widths: tuple[int, int] | None = None):
        self.batch, self.device, self.vocab, self.dep_steps = batch, device, vocab, dep_steps
        self.fixed = widths
        self.every_frame = False
        self.temp = [torch.ones(batch, device=device) for _ in range(2)]  # text, audio
        self.top_k = [torch.ones(batch, dtype=torch.long, device=device) for _ in range(2)]
        self.greedy = [torch.ones(batch, dtype=torch.bool, device=device) for _ in range(2)]
        self.rows: list[Sampling | None] = [None] * batch  # None: a free row, drawing nothing
        self.rngs: list[Noise | None] = [None] * batch
        self.keys = torch.zeros(batch, 2, dtype=torch.long, device=device)  # keyed rows'
        self.generated = torch.zeros(batch, dtype=torch.bool, device=device)  # the others
        self.noise = self._buffers(widths or (1, 1))

    def _buffers(self, widths: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        text = torch.ones(self.batch, widths[0], device=self.device)
        audio = torch.ones(self.batch, self.dep_steps, widths[1], device=self.device)
        # What keyed_noise computes in and writes to, and the ranks it hashes, made once.
        self._keyed = [(torch.empty_like(noise),
                        tuple(torch.empty(noise.shape, dtype=torch.long, device=self.device)
                              for _ in range(2)),
                        ranks(noise.shape[1], noise.shape[2], self.device, first_draw))
                       for noise, first_draw in ((text[:, None], 0), (audio, 1))]
        return text, audio

    def check(self, sampling: Sampling) -> None:
        """Raises ValueError for a top-k wider than this engine's fixed noise widths."""
        for kind, top_k in enumerate((sampling.top_k_text, sampling.top_k_audio)):
            if self.fixed and self.width(top_k, kind) > self.fixed[kind]:
                raise ValueError(f"{('text', 'audio')[kind]} top-k {top_k or 'all'} is over "
                                 f"this engine's limit of {self.fixed[kind]}")

    def set(self, row: int, sampling: Sampling | None, rng: Noise | None = None) -> None:
        """Row `row` samples by `sampling` (None: a free row) with noise from `rng`: a key
        (None: a fresh one) or a generator."""
        if sampling is not None:
            self.check(sampling)
            if rng is None:
                rng = noise_key()
            if not isinstance(rng, torch.Generator):
                self.keys[row, 0], self.keys[row, 1] = rng & _MASK32, (rng >> 32) & _MASK32
        self.rows[row], self.rngs[row] = sampling, rng
        self.generated[row] = isinstance(rng, torch.Generator)
        if sampling is None:
            sampling = Sampling(greedy=True, top_k_text=1, top_k_audio=1)
        params = ((sampling.temp_text, sampling.top_k_text),
                  (sampling.temp_audio, sampling.top_k_audio))
        for kind, (temp, top_k) in enumerate(params):
            self.temp[kind][row] = temp
            self.top_k[kind][row] = min(top_k, self.vocab[kind])
            self.greedy[kind][row] = sampling.greedy or temp <= 0

    def width(self, top_k: int, kind: int) -> int:
        return self.vocab[kind] if top_k == 0 else min(top_k, self.vocab[kind])

    def draws(self, sampling: Sampling) -> list[tuple[int, int]]:
        """What one frame draws for a row of `sampling`: (kind, count) in order."""
        out = []
        for kind, (temp, top_k) in enumerate(((sampling.temp_text, sampling.top_k_text),
                                              (sampling.temp_audio, sampling.top_k_audio))):
            if not (sampling.greedy or temp <= 0):
                out += [(kind, self.width(top_k, kind))] * (1 if kind == 0 else self.dep_steps)
        return out

    def draw_generators(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The noise buffers, [B, K_text] and [B, dep_steps, K_audio], sized for the rows'
        top-k, with this frame's draws of the rows that have a generator."""
        if not self.fixed:
            widths = [max([1] + [self.width(s.top_k_audio if kind else s.top_k_text, kind)
                                 for s in self.rows if s is not None]) for kind in (0, 1)]
            if (widths[0], widths[1]) != (self.noise[0].shape[1], self.noise[1].shape[2]):
                self.noise = self._buffers((widths[0], widths[1]))
        text, audio = self.noise
        for row, (sampling, rng) in enumerate(zip(self.rows, self.rngs)):
            if sampling is None or not isinstance(rng, torch.Generator):
                continue
            step = 0
            for kind, count in self.draws(sampling):
                target = text[row] if kind == 0 else audio[row, step]
                target[:count].exponential_(1, generator=rng)
                step += kind
        return text, audio

    def with_keyed(self, offsets: torch.Tensor, text: torch.Tensor, audio: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The noise of the first n rows (offsets [n], their frame offsets; n = B, or fewer
        for a step of those rows alone): text [n, K_text] and audio [n, dep_steps,
        K_audio], with every keyed row's made for its offset, one computation for each
        kind."""
        n = len(offsets)
        kinds = {0, 1}
        if not self.every_frame:
            kinds = {kind for sampling, rng in zip(self.rows[:n], self.rngs[:n])
                     if sampling is not None and not isinstance(rng, torch.Generator)
                     for kind, _ in self.draws(sampling)}
        if not kinds:
            return text, audio
        rows = row_hashes(self.keys[:n], offsets)
        # A graph holds every case; eager steps skip the merge when no row has a generator.
        mixed = self.every_frame or any(isinstance(rng, torch.Generator)
                                        for rng in self.rngs[:n])
        merged = []
        for kind, noise in enumerate((text[:, None], audio)):
            keyed, work, ranked = self._keyed[kind]
            if kind in kinds:
                keyed_noise(rows, ranked, keyed[:n], tuple(w[:n] for w in work))
                noise = (torch.where(self.generated[:n, None, None], noise, keyed[:n])
                         if mixed else keyed[:n])
            merged.append(noise)
        return merged[0][:, 0], merged[1]


class FirstRows:
    """The first `rows` rows of a RowSampling, for a step of those rows alone: the same
    parameter tensors (views), and each frame's noise drawn by the whole, whose free rows
    draw nothing."""

    def __init__(self, whole: RowSampling, rows: int):
        self.whole, self.rows = whole, rows
        self.temp = [t[:rows] for t in whole.temp]
        self.top_k = [t[:rows] for t in whole.top_k]
        self.greedy = [t[:rows] for t in whole.greedy]

    def draw_generators(self) -> tuple[torch.Tensor, torch.Tensor]:
        text, audio = self.whole.draw_generators()
        return text[:self.rows], audio[:self.rows]

    def with_keyed(self, offsets: torch.Tensor, text: torch.Tensor, audio: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.whole.with_keyed(offsets, text, audio)


def advance_rng(rng: Noise, frames: int, draws: list[tuple[int, int]]) -> None:
    """Moves a generator on as `frames` frames of `draws` (RowSampling.draws) would (a key
    needs nothing: its noise follows the row's frame offset)."""
    if not isinstance(rng, torch.Generator) or not draws or frames <= 0:
        return
    scratch = torch.empty(max(count for _, count in draws), device=rng.device)
    for _ in range(frames):
        for _, count in draws:
            scratch[:count].exponential_(1, generator=rng)
