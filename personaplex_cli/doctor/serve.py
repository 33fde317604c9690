"""What `serve` needs beyond the model: its web stack, Opus (sphn 0.2), its default port."""

from __future__ import annotations

from ..serve.protocol import DEFAULT_PORT
from .check import OK, WARN, Check

SERVE_PACKAGES = ("sphn", "starlette", "uvicorn", "websockets")


def check_serve() -> Check:
    """What `serve` needs beyond the model: its web stack and Opus, and its default port."""
    import socket
    from importlib.metadata import PackageNotFoundError, version

    found, missing = [], []
    for name in SERVE_PACKAGES:
        try:
            __import__(name)
            found.append(f"{name} {version(name)}")
        except (ImportError, PackageNotFoundError):
            missing.append(name)
    if missing:
        return Check("serve", WARN, f"{', '.join(missing)} not installed: serve cannot run",
                     f"pip install {' '.join(missing)}")
    import sphn

    if hasattr(sphn.OpusStreamWriter, "read_bytes"):  # 0.1's API: append, then poll
        return Check("serve", WARN, f"sphn {version('sphn')} is too old: serve needs 0.2",
                     "pip install 'sphn>=0.2,<0.3'")
    detail = ", ".join(found)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", DEFAULT_PORT))
        except OSError:
            return Check("serve", WARN, f"{detail}; port {DEFAULT_PORT} is in use",
                         "stop what listens there, or serve --port N")
    return Check("serve", OK, f"{detail}; port {DEFAULT_PORT} free")
