"""Ray, imported and joined: the only place that decides how a command gets its cluster.

ADDRESS is what `ray.init` takes: `local` starts a Ray on this machine for this run only
(on 127.0.0.1), `auto` joins the cluster this machine is part of (or $RAY_ADDRESS,
which `ray job submit` sets for its entrypoint), HOST:PORT joins that head node, and
ray://HOST:PORT goes through Ray Client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys

from ..errors import ClusterError, PersonaplexError

RAY_EXTRA = "pip install 'personaplex-cli[ray]'"
LOCAL = "local"


def remote_error(message: str, exit_code: int) -> PersonaplexError:
    """An error a worker or replica reported (its words and exit status), raised here."""
    error = PersonaplexError(str(message))
    error.exit_code = int(exit_code)
    return error


def import_ray(address: str | None = None):
    """The ray module, or ClusterError (exit 9) saying how to get it. For a `local`
    cluster, Ray is told before it is imported to keep to this machine: on Linux it binds
    even a one-machine cluster to the machine's reachable address, unless its one-machine
    mode (the one it has on macOS and Windows) is on, which binds to the loopback."""
    if address == LOCAL:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
        import ray.data  # noqa: F401 - the [data] part of the extra
    except ImportError as error:
        raise ClusterError(f"--ray needs Ray, which is not installed ({error.name or error}): "
                           f"{RAY_EXTRA}") from None
    return ray


def connect(address: str, *, verbose: int = 0, worker_logs=None):
    """Joins (or for `local`, starts) the cluster -> the ray module. Ray's own chatter
    stays off stderr unless -vv; what the workers that `worker_logs(actor_name)` picks
    print comes to stderr."""
    ray = import_ray(address)
    if ray.is_initialized():
        return ray
    if verbose < 2:  # the core worker's C++ log lines (errors too) go straight to fd 2
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    _keep_stdout_ours(verbose, worker_logs)
    if worker_logs is not None:  # every worker's lines, not one for all that print alike
        from ray._private import ray_logging  # read from RAY_DEDUP_LOGS at import

        ray_logging.RAY_DEDUP_LOGS = False
    _check_reachable(address)
    # A cluster for this run alone needs no dashboard.
    options = {"include_dashboard": False} if address == LOCAL else {}
    try:
        with _stderr_muted(verbose < 2):  # which says so, in a line of its own
            ray.init(address=address, logging_level=logging.INFO if verbose >= 2 else
                     logging.ERROR, log_to_driver=worker_logs is not None or verbose >= 2,
                     **options)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ClusterError(f"cannot join the Ray cluster at {address}: {reason[:300]}") \
            from None
    for name in ("ray", "ray.data", "ray.serve"):
        logging.getLogger(name).setLevel(logging.INFO if verbose >= 2 else logging.ERROR)
    return ray


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """ClusterError at once for a HOST:PORT nothing listens on (ray.init would retry it
    for minutes)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address in (LOCAL, "auto") or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout).close()
    except OSError as error:
        raise ClusterError(f"cannot join the Ray cluster at {address}: "
                           f"{error.strerror or error}") from None


@contextlib.contextmanager
def _stderr_muted(muted: bool):
    """File descriptor 2 on /dev/null meanwhile (what Ray's C++ writes there)."""
    if not muted:
        yield
        return
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _keep_stdout_ours(verbose: int, worker_logs) -> None:
    """Ray's driver prints what the cluster reports (a worker that died, a task retried)
    on stdout, where the command's results and --json lines go: those go to stderr with
    -v, nowhere without (the run reports its own progress); what workers print, when
    asked for, to stderr too. Ray 2.60 has no setting for
    it, so its printer is wrapped, before ray.init hands it to its threads."""
    from ray._private import worker

    printer = getattr(worker.print_to_stdstream, "prints_to", worker.print_to_stdstream)

    def wanted(data) -> bool:
        if verbose >= 2:
            return True
        if data.get("pid") == "raylet":
            return verbose >= 1
        return worker_logs is not None and worker_logs(data.get("actor_name") or "")

    def to_stderr(data, ignore_prefix):
        if wanted(data):
            printer({**data, "is_err": True}, ignore_prefix)

    to_stderr.prints_to = printer
    worker.print_to_stdstream = to_stderr


def cluster_gpus(ray) -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def cluster_cpus(ray) -> int:
    return int(ray.cluster_resources().get("CPU", 0))


def wants_gpus(ray, device: str) -> bool:
    """Whether the workers run on GPUs: --device cuda, or auto on a cluster that has some
    (the machine running the command may have none: the head of a GPU cluster often does
    not). DeviceError for cuda on a cluster without GPUs."""
    from ..errors import DeviceError

    gpus = cluster_gpus(ray)
    if device.startswith("cuda"):
        if gpus < 1:
            raise DeviceError("--device cuda: the Ray cluster has no GPU")
        return True
    return device == "auto" and gpus > 0


def model_spec_for_nodes(spec: str) -> str:
    """The --model value as every node should resolve it: a folder by its absolute path
    (on a filesystem the nodes share), a hub repo id as it is (each node's own cache)."""
    folder = os.path.expanduser(spec)
    return os.path.abspath(folder) if os.path.isdir(folder) else spec


@dataclasses.dataclass
class Pool:
    """What the workers run on, decided once the cluster is joined."""

    workers: int
    gpus: bool
    threads: int | None  # intra-op threads of a CPU worker (None: the GPU's)
    resources: dict  # map_batches' num_gpus / num_cpus per worker


def plan_pool(ray, device: str, workers: int | None, rows: int = sys.maxsize) -> Pool:
    """One worker (a batch actor, a Serve replica) per GPU of the cluster by default (or
    one, on CPUs), never more than --workers (--replicas) nor than there are rows. A CPU
    worker computes with the thread count this command would use on its own (torch's,
    from OMP_NUM_THREADS), so that its bytes are a local run's; it reserves that many
    CPUs, or its share when they do not go round."""
    import torch

    gpus = wants_gpus(ray, device)
    count = max(1, min(workers or (cluster_gpus(ray) if gpus else 1), rows))
    if gpus:
        return Pool(count, True, None, {"num_gpus": 1})
    threads = torch.get_num_threads()
    share = max(1, min(threads, cluster_cpus(ray) // count))
    return Pool(count, False, threads, {"num_cpus": share})
