"""`reply --manifest --ray`: the checked jobs answered by a pool of Ray Data workers.

The command checks every row as on one machine (batch.check, before any weight loads);
the jobs to run become a dataset of one row each, and `map_batches` hands them, a few at
a time, to an actor pool (`ray.data.ActorPoolStrategy`). Each worker loads the model once
(on one GPU, or a share of the CPUs) and keeps one batch of `capacity` rows, the capacity
the same run has on one machine, min(--batch-size, rows to answer): a batch of one row
rounds its matrix products otherwise. It answers the rows it gets with batch.run, so with
the continuous batching of one machine, and writes each job's outputs atomically where
every node sees them (a shared filesystem, or an fsspec URL). Since a reply depends only
on its row, its seed and that capacity (batch.attend_over_whole_windows), every output is
the bytes a local run writes. The worker yields an event as each row ends, and the frames
made twice a second, so the command reports as a local run does.

A worker that dies (its process killed, its machine lost) is restarted by Ray Data and its
task rerun (its own fault tolerance: max_restarts and max_task_retries of -1, which Ray 2.60
gives no undeprecated way to bound): a row it had finished is whole and left as it is, a row it had begun is answered
again, and the partial files it left are removed when the run ends.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
import time
from typing import Callable

from .. import batch
from ..outputs import output_exists, remove_stale_parts
from ..errors import ClusterError, PersonaplexError

EVENT_S = 0.5  # a worker reports the frames it made at most this often
BATCHES_PER_TASK = 4  # rows handed to a worker at once: this many batches' worth, at most


def _event(kind: str, index: int = -1, *, frames: int = 0, seconds: float = 0.0,
           error: str = "", exit_code: int = 0) -> dict:
    """One row of what a worker yields (every row has every column)."""
    return {"kind": [kind], "index": [index], "frames": [frames], "seconds": [seconds],
            "error": [error], "exit_code": [exit_code], "worker": [WORKER]}


def _worker_name() -> str:
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


WORKER = _worker_name()  # in each worker's process: the module is imported there


class ReplyWorker:
    """One Ray Data actor: a model and its batch, kept from one task to the next."""

    def __init__(self, *, model: str, device: str, dtype: str | None, quantize: str,
                 capacity: int, sampling: dict, rate: int, keep_going: bool,
                 threads: int | None, max_prime_s: float = 0.0,
                 graphs: bool | None = None):
        from ..core.sampling import Sampling
        from ..model.model import Model
        from ..runtime import open as open_runtime
        from ..runtime.personas import Personas
        from ..runtime.scheduler import Pacing

        self.model = Model.open(model, device, dtype, quantize, graphs=graphs)
        # On CPUs the thread count changes how products round: the driver's `threads`.
        self.scheduler = open_runtime(self.model, None, capacity, Pacing.FREE,
                                      option="--batch-size", threads=threads)
        self.personas = Personas(self.model)
        self.capacity = capacity
        self.sampling = Sampling(**sampling)
        self.rate = rate
        self.keep_going = keep_going
        self.max_prime_s = max_prime_s

    def __call__(self, rows):
        jobs, formats, events = [], {}, queue.SimpleQueue()
        for text, sample_format in zip(rows["job"], rows["sample_format"]):
            job = batch.Job(**json.loads(str(text)))
            formats[job.audio] = str(sample_format)
            if not job.replace:  # nothing was there when the run was checked
                if job.complete():  # an earlier attempt of this task wrote it whole
                    yield _event("done", job.index, frames=-1)
                    continue
                # An earlier attempt wrote some of its files: this one writes them again.
                job.replace = any(output_exists(path) for path in job.outputs)
            jobs.append(job)
        worker = threading.Thread(target=self._answer, args=(jobs, formats, events),
                                  name="reply", daemon=True)
        worker.start()
        while (event := events.get()) is not None:
            if isinstance(event, BaseException):
                worker.join()
                raise event
            yield event
        worker.join()

    def _answer(self, jobs, formats, events: queue.SimpleQueue) -> None:
        made, last = 0, time.monotonic()

        def on_frames(count: int) -> None:
            nonlocal made, last
            made += count
            if time.monotonic() - last >= EVENT_S:
                events.put(_event("frames", frames=made))
                made, last = 0, time.monotonic()

        def on_failed(failure: batch.Failure) -> None:
            events.put(_event("failed", failure.job.index, error=failure.error.message,
                              exit_code=failure.error.exit_code))

        try:
            batch.run(self.scheduler, jobs, self.personas, self.sampling, rate=self.rate,
                      sample_formats=formats, keep_going=self.keep_going,
                      on_done=lambda done: events.put(_event(
                          "done", done.job.index, frames=done.frames, seconds=done.seconds)),
                      on_failed=on_failed, on_frames=on_frames, max_prime_s=self.max_prime_s)
        except PersonaplexError as error:  # without --keep-going: the run stops here
            events.put(_event("stop", error=error.message, exit_code=error.exit_code))
        except BaseException as error:  # noqa: BLE001 - raised in the actor, for Ray
            events.put(error)
        finally:
            for slot in range(self.capacity):  # a row left by a failure would stay busy
                self.scheduler.leave(slot)
            if made:
                events.put(_event("frames", frames=made))
            events.put(None)


def answer_on_ray(ray, pool, jobs: list, *, model: str, device: str, dtype: str | None,
                  quantize: str, sampling, capacity: int, rate: int,
                  sample_formats: dict[str, str], keep_going: bool, expected: dict,
                  on_done: Callable, on_failed: Callable, on_frames: Callable,
                  max_prime_s: float = 0.0, graphs: bool | None = None) -> None:
    """Answers `jobs` (checked) on the pool, reporting through the callbacks as batch.run
    does; `expected[index]` is a job's frame count where known. Without `keep_going` the
    first failure stops the run and is raised (as one machine raises it)."""
    from ..runtime.rows import longest_first
    from .ray_cluster import model_spec_for_nodes, remote_error

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the command draws its own
    context.print_on_execution_start = False
    context.enable_auto_log_stats = False
    context.raise_original_map_exception = True  # a worker's PersonaplexError as it is
    context.target_max_block_size = 1  # each event a block: it comes as it is yielded
    # The longest first over the whole cluster, as one machine starts them (and each
    # worker again over the rows it gets): the run ends on short replies.
    rows = [{"job": json.dumps(dataclasses.asdict(job)),
             "sample_format": sample_formats[job.audio]}
            for job in longest_first(jobs, lambda job: expected.get(job.index))]
    per_task = max(1, min(capacity * BATCHES_PER_TASK, math.ceil(len(jobs) / pool.workers)))
    events = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ReplyWorker, batch_size=per_task,
        # A fixed pool, whose rows wait for every worker to be ready, and one task at a
        # time per worker (a worker answers one anyway): else the first ready takes them.
        compute=ray.data.ActorPoolStrategy(size=pool.workers,
                                           max_tasks_in_flight_per_actor=1),
        fn_constructor_kwargs=dict(
            model=model_spec_for_nodes(model), device="cuda" if pool.gpus else "cpu",
            dtype=dtype, quantize=quantize, capacity=capacity,
            sampling=dataclasses.asdict(sampling), rate=rate, keep_going=keep_going,
            threads=pool.threads, max_prime_s=max_prime_s, graphs=graphs),
        **pool.resources)
    by_index = {job.index: job for job in jobs}
    reported: set[int] = set()
    try:
        for event in _events(ray, events):
            kind = event["kind"]
            if kind == "frames":
                on_frames(int(event["frames"]))
                continue
            if kind == "stop":
                raise remote_error(event["error"], event["exit_code"])
            index = int(event["index"])
            if index in reported:  # a task rerun after its worker died says it again
                continue
            reported.add(index)
            job = by_index[index]
            if kind == "done":
                frames = int(event["frames"])
                on_done(batch.Done(job, (expected.get(index) or 0) if frames < 0 else frames,
                                   float(event["seconds"]), str(event["worker"])))
            else:
                on_failed(batch.Failure(job, remote_error(event["error"], event["exit_code"])))
        # Every task ended, so every row was answered (or failed) by its last attempt.
        # A task rerun after its worker died yields its events anew, but Ray drops as many
        # of them as the first attempt had yielded (it takes a rerun's outputs for the
        # same as the first's), so some rows are told of by their files alone.
        for job in jobs:
            if job.index not in reported:
                if job.complete():
                    on_done(batch.Done(job, expected.get(job.index) or 0, 0.0))
                else:
                    on_failed(batch.Failure(job, ClusterError(
                        "its worker died and its rerun left no reply")))
    finally:
        for job in jobs:
            for path in job.outputs:
                remove_stale_parts(path)


def _events(ray, dataset):
    """The workers' events as they come; Ray's own failures as one-line errors."""
    try:
        yield from dataset.iter_rows()
    except PersonaplexError:
        raise
    except ray.exceptions.RayError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, PersonaplexError):
            raise cause from None
        reason = " ".join(str(error).split())
        raise ClusterError(f"the Ray run failed: {reason[:300]}") from None
