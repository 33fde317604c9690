"""Prometheus text exposition (format 0.0.4) of the server's figures, at `/metrics`."""

from __future__ import annotations

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Exposition:
    """Metric families added one by one, rendered as the text format."""

    def __init__(self, prefix: str = "personaplex_"):
        self.prefix = prefix
        self._lines: list[str] = []

    def add(self, name: str, kind: str, help_text: str,
            samples: list[tuple[dict, float | None]] | float | None) -> None:
        """`samples`: one value, or (labels, value) pairs; a None value is left out."""
        full = self.prefix + name
        self._lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        if not isinstance(samples, list):
            samples = [({}, samples)]
        for labels, value in samples:
            if value is None:
                continue
            tag = ",".join(f'{key}="{value_}"' for key, value_ in labels.items())
            self._lines.append(f"{full}{{{tag}}} {value:g}" if tag else f"{full} {value:g}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
