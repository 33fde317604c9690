"""The `reply --manifest` file: one recording to answer per row.

Two spellings of the same rows:
  JSON lines   one object per line (blank lines skipped), e.g.
               {"input": "calls/a.wav", "output": "out/a.wav", "voice": "NATM1", "seed": 7}
  CSV          a header row naming the fields, then one row per recording.
A file ending in .csv is CSV, one ending in .jsonl/.ndjson/.json is JSON lines; otherwise (or
on stdin) a first non-blank character `{` means JSON lines.

Fields: `input` and `output` (required); `voice`, `prompt`, `seed`, `text_out`, `codes_out`,
`tail_silence` (optional), taking the values the options of the same name take. A field left
out (or, in CSV, left empty; in JSON, null) takes the option's value; an empty `voice` means
no voice, as `--voice ''` does, and a null `voice` is refused as ambiguous. Relative paths
resolve against the manifest's folder. A UTF-8 byte order mark (Excel's "CSV UTF-8") is
skipped. Rows keep the line they came from, so every message can point at it, and every
bad row is found in one pass.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .core.config import MAX_SEED
from .errors import InputError

FIELDS = ("input", "output", "voice", "prompt", "seed", "text_out", "codes_out",
          "tail_silence")
MAX_TAIL_SILENCE = 600.0


class ManifestError(InputError):
    """The manifest, or one of its rows, cannot be used (exit 7)."""


@dataclass
class ManifestRow:
    source: str  # the manifest's name, for messages
    line: int  # where the row starts in the file (1-based)
    values: dict[str, Any] = field(default_factory=dict)  # the fields given, typed
    problem: ManifestError | None = None  # why the row cannot be used (the others can)


def _typed(name: str, value: Any, where: str) -> Any:
    if name == "seed":
        if isinstance(value, str):
            value = value.strip()
            if not value.lstrip("-").isdigit():
                raise ManifestError(f"{where}: seed {value!r} is not an integer")
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEED:
            raise ManifestError(f"{where}: seed must be an integer within 0..{MAX_SEED}")
        return value
    if name == "tail_silence":
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ManifestError(f"{where}: tail_silence {value!r} is not a number of "
                                "seconds") from None
        if not math.isfinite(value) or not 0 <= value <= MAX_TAIL_SILENCE:
            raise ManifestError(f"{where}: tail_silence must be within 0..{MAX_TAIL_SILENCE:g} "
                                "seconds")
        return value
    if not isinstance(value, str):
        raise ManifestError(f"{where}: {name} must be a string")
    if name == "prompt":
        from .model.tokenizer import not_utf8

        problem = not_utf8(value, f"{where}: the prompt")
        if problem is not None:
            raise ManifestError(problem)
    return value


def _row(line: int, raw: dict[str, Any], source: str, csv_row: bool) -> ManifestRow:
    where = f"{source}:{line}"
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ManifestError(f"{where}: unknown field {unknown[0]!r} (fields: "
                            f"{', '.join(FIELDS)})")
    values = {}
    for name, value in raw.items():
        if name == "voice" and value is None:
            raise ManifestError(f'{where}: voice is null: write "" for no voice, or leave '
                                "the field out for --voice's")
        if value is None or (csv_row and value == "" and name != "voice"):
            continue  # left out: the option's value
        values[name] = _typed(name, value, where)
    for name in ("input", "output"):
        if not values.get(name):
            raise ManifestError(f"{where}: the row has no {name}")
    return ManifestRow(source, line, values)


def _checked_row(line: int, source: str, make) -> ManifestRow:
    """The row `make()` builds, or one that says why it cannot be used."""
    try:
        return make()
    except ManifestError as error:
        return ManifestRow(source, line, problem=error)


def _json_rows(text: str, source: str) -> list[ManifestRow]:
    def parsed(number: int, line: str) -> ManifestRow:
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            raise ManifestError(f"{source}:{number}: not JSON ({error.msg})") from None
        if not isinstance(raw, dict):
            raise ManifestError(f"{source}:{number}: each line must be a JSON object")
        return _row(number, raw, source, csv_row=False)

    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            rows.append(_checked_row(number, source, lambda: parsed(number, line)))
    return rows


def _csv_rows(text: str, source: str) -> list[ManifestRow]:
    reader = csv.DictReader(io.StringIO(text, newline=""), restkey="\0extra")
    if not reader.fieldnames:
        raise ManifestError(f"{source}: no header row")

    def parsed(line: int, raw: dict) -> ManifestRow:
        if "\0extra" in raw:
            raise ManifestError(f"{source}:{line}: more values than the header names")
        if any(value is None for value in raw.values()):
            raise ManifestError(f"{source}:{line}: fewer values than the header names")
        return _row(line, {k.strip(): v for k, v in raw.items()}, source, csv_row=True)

    rows = []
    for raw in reader:
        line = reader.line_num  # where the row ends (a quoted field may span lines)
        if any(value is None or value.strip() for value in raw.values()):
            rows.append(_checked_row(line, source, lambda: parsed(line, raw)))
    return rows


def read_manifest(path: str, stdin: TextIO | None = None, *, bad_rows: bool = False
                  ) -> tuple[list[ManifestRow], Path]:
    """The rows of a manifest file (`-`: stdin) -> (rows, the folder relative paths are in).
    With `bad_rows`, a row that cannot be used comes back with its `problem` (the caller
    reports it with the others); else all of them are raised at once."""
    try:
        if path == "-":
            text, folder, source = (stdin.read() if stdin else ""), Path.cwd(), "stdin"
        else:
            text = Path(path).read_text(encoding="utf-8-sig")
            folder, source = Path(path).resolve().parent, path
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ManifestError(f"cannot read the manifest {path}: {reason}") from None
    text = text.removeprefix("\ufeff")  # a byte order mark on stdin
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json") or (
            suffix != ".csv" and text.lstrip().startswith("{")):
        rows = _json_rows(text, source)
    else:
        rows = _csv_rows(text, source)
    if not rows:
        raise ManifestError(f"{source}: the manifest has no rows")
    bad = [row.problem for row in rows if row.problem is not None]
    if bad and not bad_rows:
        raise ManifestError("; ".join(problem.message for problem in bad))
    return rows, folder
