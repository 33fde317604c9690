"""A headless virtual full-duplex sound device for the live-audio tests (no sound card needed).

Set up from Python, so the suite runs on a fresh clone alone: a private PulseAudio daemon
with two null sinks reached through ALSA's pulse plugin, so PortAudio's default output plays
into sink "speaker" and its default input records the monitor of sink "micsink".

- feed the "microphone": `va.play_to_mic(wav)` (paplay -d micsink, paced in real time);
- record the "speaker":   `va.record_speaker(wav)` (parecord -d speaker.monitor), `.stop()`;
- an acoustic echo path:  `va.echo(delay_ms, volume_percent)` / `va.echo_off()` (a loopback
  speaker.monitor -> micsink; PulseAudio volume is cubic: 60 % = -13.3 dB);
- `va.kill_server()` kills the daemon (SIGKILL), like a sound server crashing.

Two non-obvious steps, each found by measuring the device as PortAudio uses it: a low-latency
keep-alive client on each null sink (else a null sink renders in 2 s blocks: late first
callbacks, PortAudio spinning, stalled streams) and waiting until each monitor delivers
audio (a fresh sink finishes its first 2 s block first).

The `virtual_audio` fixture FAILS (never skips) when the device cannot be started: CI must
exercise the live path. On Debian as root it installs the packages it lacks
(`DEBIAN_PACKAGES`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

RATE = 24000
DEBIAN_PACKAGES = ("libportaudio2", "pulseaudio", "pulseaudio-utils", "libasound2-plugins")
TOOLS = ("pulseaudio", "pactl", "pacat", "parec", "paplay", "parecord")


class VirtualAudioError(RuntimeError):
    pass


def _missing_packages() -> list[str]:
    if not shutil.which("dpkg-query"):
        return []
    missing = []
    for package in DEBIAN_PACKAGES:
        # `dpkg -s` wrongly succeeds for removed packages: read the Status field.
        status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                                capture_output=True, text=True).stdout
        if status != "install ok installed":
            missing.append(package)
    return missing


def ensure_packages() -> None:
    """Install the Debian packages when missing (root with apt-get), else explain what to do."""
    missing = _missing_packages()
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode:
                raise VirtualAudioError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        missing = _missing_packages()
    absent = [tool for tool in TOOLS if not shutil.which(tool)]
    if missing or absent:
        raise VirtualAudioError(
            f"the virtual audio device needs {' '.join(missing or DEBIAN_PACKAGES)}"
            f" (apt-get install --no-install-recommends {' '.join(DEBIAN_PACKAGES)})"
            + (f"; missing tools: {', '.join(absent)}" if absent else ""))


class Recorder:
    """A running `parecord` of the speaker; `stop()` finalises the WAV (SIGINT) and returns it."""

    def __init__(self, proc: subprocess.Popen, path: Path):
        self.proc, self.path = proc, path

    def stop(self, timeout: float = 10) -> Path:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout)
        return self.path


class VirtualAudio:
    """One private PulseAudio daemon (its own socket and runtime directory)."""

    def __init__(self, root: Path | None = None, rate: int = RATE):
        # A unix socket path must stay under ~108 bytes: a short directory in /tmp.
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="ppx-va-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.rate = rate
        self.socket = self.root / "pulse.sock"
        self.runtime = self.root / "runtime"
        self.log = self.root / "pulse.log"
        self.env = {"PULSE_SERVER": f"unix:{self.socket}", "PULSE_RUNTIME_PATH": str(self.runtime)}
        self._daemon: subprocess.Popen | None = None
        self._helpers: list[subprocess.Popen] = []
        self._echo_module: str | None = None

    # -- life cycle -----------------------------------------------------------------------
    def start(self, timeout: float = 15) -> VirtualAudio:
        ensure_packages()
        self.runtime.mkdir(parents=True, exist_ok=True)
        self.runtime.chmod(0o700)
        script = self.root / "test.pa"
        fmt = f"rate={self.rate} channels=1 format=float32le"
        script.write_text(
            f"load-module module-native-protocol-unix auth-anonymous=1 socket={self.socket}\n"
            f"load-module module-null-sink sink_name=speaker {fmt}\n"
            f"load-module module-null-sink sink_name=micsink {fmt}\n"
            "set-default-sink speaker\nset-default-source micsink.monitor\n")
        # As root this prints a "not intended to be run as root" warning and works.
        self._daemon = subprocess.Popen(
            ["pulseaudio", "-n", "-F", str(script), "--daemonize=no", "--exit-idle-time=-1",
             f"--log-target=file:{self.log}"],
            env=self._env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while not self._pactl_ok():
            if self._daemon.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise VirtualAudioError(f"pulseaudio did not start; see {self.log}: {self._log_tail()}")
            time.sleep(0.1)
        for sink in ("speaker", "micsink"):  # keep-alives (see the module docstring)
            self._helpers.append(subprocess.Popen(
                ["pacat", "--playback", "-d", sink, "--latency-msec=20", "--raw", "--format=float32le",
                 f"--rate={self.rate}", "--channels=1", "--client-name=keepalive", "/dev/zero"],
                env=self._env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        for sink in ("speaker", "micsink"):
            self._wait_for_monitor(sink, max(1.0, deadline - time.monotonic()))
        return self

    def stop(self) -> None:
        if self._daemon is not None and self._daemon.poll() is None:
            self._daemon.send_signal(signal.SIGCONT)  # in case a test froze it
        for proc in [*self._helpers, self._daemon]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self._helpers = []
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def kill_server(self) -> None:
        """SIGKILL the daemon (a crash: no goodbye to its clients)."""
        assert self._daemon is not None
        self._daemon.kill()
        self._daemon.wait(5)

    def freeze_server(self) -> None:
        """SIGSTOP the daemon: a hung sound server (clients block, nothing errors)."""
        assert self._daemon is not None
        self._daemon.send_signal(signal.SIGSTOP)

    @property
    def running(self) -> bool:
        return self._daemon is not None and self._daemon.poll() is None

    # -- test signals ---------------------------------------------------------------------
    def play_to_mic(self, wav: Path) -> subprocess.Popen:
        return subprocess.Popen(["paplay", "-d", "micsink", str(wav)], env=self._env(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def record_speaker(self, wav: Path) -> Recorder:
        proc = subprocess.Popen(
            ["parecord", "-d", "speaker.monitor", f"--rate={self.rate}", "--channels=1",
             "--format=float32le", "--file-format=wav", str(wav)],
            env=self._env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return Recorder(proc, wav)

    def echo(self, delay_ms: int = 40, volume_percent: int = 60) -> None:
        """What the speaker plays reaches the microphone `delay_ms` later (plus buffering)."""
        self.echo_off()
        self._echo_module = self._pactl(
            "load-module", "module-loopback", "source=speaker.monitor", "sink=micsink",
            f"latency_msec={delay_ms}", "source_dont_move=true", "sink_dont_move=true").strip()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # its playback stream appears a moment later
            rows = [line.split("\t") for line in self._pactl("list", "short", "sink-inputs").splitlines()]
            loop = [r[0] for r in rows if len(r) > 3 and r[3] == "module-loopback.c"]
            if loop:
                self._pactl("set-sink-input-volume", loop[-1], f"{volume_percent}%")
                return
            time.sleep(0.1)
        raise VirtualAudioError("the echo loopback's stream did not appear")

    def echo_off(self) -> None:
        if self._echo_module:
            self._pactl("unload-module", self._echo_module, check=False)
            self._echo_module = None

    # -- helpers --------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def _pactl(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(["pactl", *args], env=self._env(), capture_output=True, text=True, timeout=10)
        if check and done.returncode:
            raise VirtualAudioError(f"pactl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def _pactl_ok(self) -> bool:
        try:
            return subprocess.run(["pactl", "info"], env=self._env(), capture_output=True,
                                  timeout=5).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _wait_for_monitor(self, sink: str, timeout: float) -> None:
        proc = subprocess.Popen(
            ["parec", "-d", f"{sink}.monitor", "--latency-msec=10", "--raw", "--format=float32le",
             f"--rate={self.rate}", "--channels=1"],
            env=self._env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            os.set_blocking(proc.stdout.fileno(), False)
            got, deadline = 0, time.monotonic() + timeout
            while got < 1920 and time.monotonic() < deadline:
                chunk = proc.stdout.read(1920 - got)
                if chunk:
                    got += len(chunk)
                else:
                    time.sleep(0.02)
            if got < 1920:
                raise VirtualAudioError(f"the {sink} monitor delivered no audio in {timeout:.0f} s")
        finally:
            proc.kill()
            proc.wait(5)

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-3:])
        except OSError:
            return "(no log)"


def _refresh_portaudio() -> None:
    # PortAudio enumerates devices once, at initialisation: re-scan if sounddevice was
    # imported before the environment changed.
    if "sounddevice" in sys.modules:
        from personaplex_cli.live.devices import refresh_devices

        refresh_devices()


@pytest.fixture(scope="session")
def virtual_audio():
    """A running VirtualAudio whose server this test process (PortAudio included) uses."""
    va = VirtualAudio()
    try:
        va.start()
    except (VirtualAudioError, OSError, subprocess.SubprocessError) as e:
        pytest.fail(f"cannot start the virtual audio device: {e}", pytrace=False)
    saved = {key: os.environ.get(key) for key in va.env}
    os.environ.update(va.env)
    _refresh_portaudio()
    try:
        yield va
    finally:
        va.echo_off()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        va.stop()
        _refresh_portaudio()
