"""The thread count serve, talk and reply share, as remembered for this machine."""

from __future__ import annotations

import os

from .check import OK, Check


def check_threads() -> Check:
    """What runtime.warmup.ThreadsMemory holds for this machine's core count, each as the
    commands' own start lines say it; "not measured yet" before serve or talk ran here."""
    from ..model.files import tool_cache_dir
    from ..runtime.warmup import THREADS_FILE, ThreadsMemory

    cores = os.cpu_count() or 1
    path = tool_cache_dir() / THREADS_FILE
    found = []
    for key in sorted(ThreadsMemory.read_all(path)):
        if key.endswith(f"/{cores} cores"):
            threads = ThreadsMemory(path, key).recall()
            if threads is not None:
                tried = ", ".join(f"{ms:.0f} ms on {n}" for n, ms in
                                  sorted(threads.tried_ms.items()))
                found.append(f"{key}: {threads.count} torch thread"
                             f"{'' if threads.count == 1 else 's'}"
                             + (f" (the fastest step: {tried})" if tried else ""))
    if not found:
        return Check("threads", OK, "not measured yet on this machine: the first serve or "
                                    "talk measures it once, and reply then uses it")
    return Check("threads", OK, "; ".join(found))
