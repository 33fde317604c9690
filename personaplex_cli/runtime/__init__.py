"""What runs conversations for every command: a row's life from its admission to its last
frame, owned here. `open(model, persona, rows, pacing)` is the one entry: serve, talk,
reply, the Ray workers and doctor --bench open their run by it.

- `scheduler`: the one `Scheduler`: the session's slots, admission, when to prime and the
               three pacings: TICK (serve, `start`/`add`/`remove`), SOURCE (talk, `follow`),
               FREE (reply and the Ray workers, `answer`); the only code that steps the
               session (core.session.Session) or primes it.
- `rows`:      the one `Row` record and its `RowState`, its sources (`LiveRow`: a network
               caller; `SourceRow`: talk's sound card or recording; `RecordingRow`,
               `OfflineRow`: a recording), and what a step hands back.
- `priming`:   whose priming runs when (order, turns, fairness) and the personas kept primed.
- `personas`:  `Personas`, the one cache of prepared personas (voice read, role tokenized).
- `stats`:     `StepStats`, the one statistics object every command reads (steps, frames,
               late, overruns, priming, step p50/p99), and `Histogram`.
- `limits`:    the bounds the runtime holds every command to (sessions, priming).
- `warmup`:    the one warm-up: torch's thread count and how many rows keep real time, from
               step times measured as the session will run (`percentile_ms` is their measure).

What stays above: serve/ keeps the network (WebSocket calls, Opus); live/ the sound card,
echo cancellation and the jitter buffer; batch.py and cluster/ reading inputs and writing
outputs. What stays below: core/ computes a step and a priming step, tensors in, tensors out.
"""

from __future__ import annotations

from typing import Callable


def open(model, persona=None, rows: int | None = None, pacing=None, *,  # noqa: A001
         option: str | None = None, threads: int | None = None, max_prime_s: float = 0.0,
         sampling=None, most: int | None = None, counts=None, frames: int | None = None,
         say: Callable[[str], None] = lambda line: None,
         warn: Callable[[str], None] = lambda line: None,
         note: Callable[[str], None] | None = None):
    """The scheduler of a run, ready: the one entry every command opens the runtime by.

    In order: the memory check before any weight loads (`rows` rows, or by default as many
    as the device's memory holds, up to `most`; exit 5 naming `option` when they do not
    fit; CUDA graphs counted as `model.graphs`, --graphs, asks), the session built (the
    model loads) with CUDA graphs captured as `model.graphs` asks (None: wherever they can
    be; a failed capture then leaves it eager, and `warn` gets the one line that says so:
    this is the one place the choice becomes an engine), then the warm-up the pacing needs
    (scheduler.Pacing), at each live count's cost (with graphs: the captured batch that
    covers it):

      TICK    serve: `persona` primed and timed, torch's threads decided on a live row,
              then 1, 2, 4, ... live rows timed, and by default the session keeps no more
              rows than keep real time; or, for doctor --bench, the row counts
              `counts(rows)` timed, `frames` each, and the rows kept as memory holds them;
      SOURCE  talk: `persona` checked against `max_prime_s`, primed in its row, the
              threads decided on it, then timed on silence;
      FREE    reply and the Ray workers: nothing is timed (a seeded reply's bytes must not
              follow a timing): the threads as `threads` says or as measured before on
              this machine; every row attends over its whole window.

    `threads`: torch's thread count as a deployment set it. `sampling`: what the warm-up's
    rows sample by (core.sampling.Sampling; None: the default). `say(line)` gets what was
    decided, in words; `note` (default `say`) the line that says the depformer compiles
    first (minutes, once: --compile). -> a scheduler.Scheduler whose `warmup` is the
    runtime.warmup.Capacity decided."""
    from ..model.memory import release_free_memory
    from .limits import MOST_SESSIONS
    from .scheduler import Pacing, Scheduler
    from .warmup import Capacity, Threads, ThreadsMemory, apply_remembered, settle
    from .warmup import SWEEP_FRAMES, warm_up_row, warm_up_slots

    pacing = Pacing.FREE if pacing is None else pacing
    fits = None
    if rows is None:
        fits = min(most or MOST_SESSIONS, max(1, model.sessions_that_fit() or 1))
    count = rows or fits
    need = model.preflight(count, option if count > 1 else None)
    say(f"memory: about {need.total / 2**30:.1f} GiB ({need})")
    line, compiling = model.compile_for(count)  # before the LM loads, at the rows it steps
    (note or say if compiling else say)(line)
    kernel = model.int8_kernel_line()
    if kernel:
        say(kernel)
    scheduler = Scheduler.for_model(model, count, graphs=getattr(model, "graphs", None))
    if scheduler.graphs_fallback:
        warn(scheduler.graphs_fallback)
    operators = model.compiled_operators_line()
    if operators:
        say(operators)
    scheduler.max_prime_s = max_prime_s
    device = model.device.type
    memory = ThreadsMemory.of_model(model)
    if pacing is Pacing.FREE:
        import torch

        if threads:
            torch.set_num_threads(threads)
            decided = Threads(threads, given="the deployment's share of the cores")
        else:  # the count serve or talk measured here: seeded bytes must not follow a timing
            decided = apply_remembered(memory, device)
        say(decided.text())
        scheduler.attend_over_whole_windows()
        scheduler.warmup = Capacity(device, decided, {}, count, count)
        return scheduler
    from ..core.sampling import Sampling

    sampling = Sampling() if sampling is None else sampling
    if pacing is Pacing.SOURCE:
        scheduler.check_priming(persona)
        scheduler.warmup = warm_up_row(scheduler, persona, sampling, 0, device,
                                       memory=memory)
    else:
        capacity = warm_up_slots(scheduler, persona, sampling, device,
                                 fits_memory=fits or count, asked=rows, threads=threads,
                                 memory=memory, frames=frames or SWEEP_FRAMES,
                                 counts=None if counts is None else counts(count))
        say(f"warm-up: priming {capacity.prime_ms:.1f} ms per frame")
        if counts is None and capacity.rows < scheduler.capacity:
            # Fewer rows than memory holds: give the rest back, the old session's memory
            # freed before the new one's is taken (graphs as the first capture left them).
            graphs = scheduler.session.graphs
            scheduler = None
            release_free_memory()
            scheduler = Scheduler.for_model(model, capacity.rows, graphs=graphs)
            scheduler.max_prime_s = max_prime_s
            settle(scheduler, persona, sampling)
        scheduler.warmup = capacity
    scheduler.measured_prime_cost_s = scheduler.warmup.prime_ms / 1000.0
    scheduler.stats.prime_cost_s = scheduler.measured_prime_cost_s
    return scheduler
