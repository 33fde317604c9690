"""Runs `python -m personaplex_cli ARGS` as a fork of an interpreter that has already
imported torch, numpy, soundfile, typer and rich, instead of a fresh interpreter each time.

Most of a test's run of the command on the tiny models is starting Python and importing
torch (about 1.5 s of the 2 s of a tiny `reply`); hundreds of runs in the suite paid it
each time. A fork keeps everything else a run sees: it is its own process with its own
exit status, signals and file descriptors 0, 1 and 2 (the test's pipes, passed over a Unix
socket), its own working directory, environment and `sys.argv`, and it imports
personaplex_cli afresh (so nothing of ours is shared between runs, and what our modules
read at import sees the run's environment). It then runs the package's `__main__` and exits
as the interpreter does (threads joined, atexit handlers, buffers flushed), but for tearing
down its modules.

What a fork cannot give is what Python and the libraries read when they start: conftest's
`run_cli` therefore starts a fresh interpreter whenever a run's environment changes a
variable of `STARTUP_VARIABLES` against the one the warm interpreter started with.

Layout: the warm interpreter (this file run as a script) listens on a socket. Each request
(a message with the run's arguments, environment and folder, and its three descriptors)
is taken by a forked handler, which forks the run itself, answers with its pid, waits for
it, and answers with its exit status (negative: the signal that ended it, as subprocess
says). The handler is a process of its own so that the listener never waits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRELOADED = ("torch", "numpy", "soundfile", "typer", "rich")
# Read by Python or a library as the process starts (or as torch first makes its thread
# pool), so a fork cannot honour a change to them.
STARTUP_VARIABLES = ("PYTHON", "LD_", "LC_", "LANG", "OMP_", "MKL_", "KMP_", "GOMP_",
                     "OPENBLAS_", "TORCH", "CUDA_", "MALLOC_")
MESSAGE_BYTES = 1 << 20


def needs_fresh_interpreter(env: dict[str, str], base: dict[str, str]) -> bool:
    changed = {key for key in env.keys() | base.keys() if env.get(key) != base.get(key)}
    return any(key.startswith(STARTUP_VARIABLES) for key in changed)


# -- the warm interpreter -------------------------------------------------------------------

def _serve(path: str) -> None:
    for name in PRELOADED:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the handler waits for its run
            _handle(conn)  # never returns
        conn.close()


def _handle(conn: socket.socket) -> None:
    message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_the_run(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
    finally:
        os._exit(0)


def _become_the_run(request: dict, fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # found again from TMPDIR when first asked, as in a new process
    _reopen_stdio()
    sys.path[0] = os.getcwd()  # as `python -m` sets it
    sys.argv = [request["argv0"], *request["args"]]
    import atexit
    import runpy

    try:
        runpy.run_module("personaplex_cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit:
        code = exit.code
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # What the interpreter does as it exits, but for tearing down every module (with
    # torch imported, most of a second): non-daemon threads joined, atexit handlers run,
    # the standard streams flushed (a failed flush is exit 120, as Python's own).
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception as error:
            os.write(2, f"Exception ignored in: {stream!r}\n{error!r}\n".encode())
            code = 120
    if code == -signal.SIGINT:  # Python ends an uncaught Ctrl-C by the signal itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _reopen_stdio() -> None:
    """New sys.stdin/stdout/stderr over descriptors 0-2, buffered as Python's own start-up
    buffers them (stdout line-buffered on a terminal only, stderr always)."""
    old = sys.stdout
    stdin = open(0, "r", encoding=sys.stdin.encoding, errors=sys.stdin.errors, closefd=False)
    stdout = open(1, "w", encoding=old.encoding, errors=old.errors, closefd=False,
                  buffering=1 if os.isatty(1) else -1)
    stderr = open(2, "w", encoding=sys.stderr.encoding, errors=sys.stderr.errors,
                  closefd=False, buffering=1)
    sys.stdin = sys.__stdin__ = stdin
    sys.stdout = sys.__stdout__ = stdout
    sys.stderr = sys.__stderr__ = stderr


# -- the test's side ------------------------------------------------------------------------

class WarmInterpreter:
    """The warm interpreter, started with `env`; `run()` mirrors subprocess.run's result."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.folder = tempfile.mkdtemp(prefix="pp-forks-", dir="/tmp")  # a short socket path
        self.path = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen([sys.executable, __file__, self.path], env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        ready = self.process.stdout.readline()
        if ready != b"ready\n":
            raise RuntimeError(f"the warm interpreter did not start: {ready!r}")

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self.folder)

    def run(self, args: list[str], *, env: dict[str, str], cwd, input: bytes | None,
            stdin, stdout, timeout: float) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "personaplex_cli", *args]
        ours: list[int] = []  # descriptors to close once the run has its copies
        readers: dict[int, threading.Thread] = {}
        captured: dict[int, bytes] = {}

        def pipe_for(name: int, given) -> int:
            if given == subprocess.PIPE:
                read, write = os.pipe()
                ours.append(write)

                def drain(fd=read):
                    with open(fd, "rb") as source:
                        captured[name] = source.read()

                readers[name] = threading.Thread(target=drain, daemon=True)
                return write
            return given if isinstance(given, int) else given.fileno()

        if input is not None:
            stdin_fd, writer_fd = os.pipe()
            ours.append(stdin_fd)
        elif stdin is None or stdin == subprocess.DEVNULL:
            stdin_fd = os.open(os.devnull, os.O_RDONLY)
            ours.append(stdin_fd)
        else:
            stdin_fd = stdin if isinstance(stdin, int) else stdin.fileno()
        fds = [stdin_fd, pipe_for(1, stdout), pipe_for(2, subprocess.PIPE)]
        request = {"args": list(args), "env": env, "cwd": str(cwd or os.getcwd()),
                   "argv0": str(Path(__file__).parents[1] / "personaplex_cli" / "__main__.py")}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
            for fd in ours:
                os.close(fd)
            for reader in readers.values():
                reader.start()
            if input is not None:
                threading.Thread(target=_feed, args=(writer_fd, input), daemon=True).start()
            deadline = time.monotonic() + timeout
            conn.settimeout(timeout)
            pid = json.loads(conn.recv(MESSAGE_BYTES))["pid"]
            try:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                answer = conn.recv(MESSAGE_BYTES)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                for reader in readers.values():
                    reader.join(5)
                raise subprocess.TimeoutExpired(argv, timeout, captured.get(1),
                                                captured.get(2)) from None
            if not answer:
                raise RuntimeError("the warm interpreter's handler ended without an answer")
            returncode = json.loads(answer)["returncode"]
        finally:
            conn.close()
        for reader in readers.values():
            reader.join(max(deadline - time.monotonic(), 1))
        return subprocess.CompletedProcess(argv, returncode, captured.get(1),
                                           captured.get(2, b""))


def _feed(fd: int, data: bytes) -> None:
    try:
        with open(fd, "wb") as sink:
            sink.write(data)
    except BrokenPipeError:
        pass  # the run stopped reading, as subprocess.run allows


# -- a shell's side --------------------------------------------------------------------------

def shell_command(warm: WarmInterpreter, folder: Path) -> Path:
    """An executable `personaplex` in `folder` for shell scripts: each run is a fork of
    `warm` with the script's descriptors 0-2, folder and environment (a fresh interpreter
    when the environment changes a start-up variable); a signal sent to it goes to the run,
    and the run's exit status is its own."""
    script = folder / "personaplex"
    script.write_text(f"#!{sys.executable}\n"
                      "import sys\n"
                      f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      "from cli_forks import run_for_shell\n"
                      f"run_for_shell({warm.path!r}, {json.dumps(warm.env)!r})\n")
    script.chmod(0o755)
    return script


def run_for_shell(path: str, base_env: str) -> None:
    args = sys.argv[1:]
    if needs_fresh_interpreter(dict(os.environ), json.loads(base_env)):
        os.execv(sys.executable, [sys.executable, "-m", "personaplex_cli", *args])
    request = {"args": args, "env": dict(os.environ), "cwd": os.getcwd(),
               "argv0": str(Path(__file__).parents[1] / "personaplex_cli" / "__main__.py")}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    pid = json.loads(conn.recv(MESSAGE_BYTES))["pid"]
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda received, frame: os.kill(pid, received))
    answer = conn.recv(MESSAGE_BYTES)
    code = json.loads(answer)["returncode"] if answer else 1
    if code < 0:  # ended by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1])
