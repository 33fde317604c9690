"""The result of one doctor check, and the exit status of them all."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EXIT_FAILURE, EXIT_OK

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str  # what was found, one line
    fix: str | None = None  # for WARN and FAIL: what to do, one line
    exit_code: int = EXIT_OK  # for FAIL: the exit status it stands for

    def as_json(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def exit_status(checks: list[Check]) -> int:
    """0 when no check failed (warnings allowed), else the exit code of the first failure."""
    return next((c.exit_code or EXIT_FAILURE for c in checks if c.status == FAIL), EXIT_OK)
