"""Reading from pipes, where one read may return fewer bytes than asked."""

from __future__ import annotations


def read_exact(stream, n: int) -> bytes:
    """Reads n bytes, looping over short reads; fewer only at end of file."""
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
