"""`personaplex help`: the manual page, whatever MANPATH says.

The page is installed as share/man/man1/personaplex.1 beside the package's bin/ (so plain
`man personaplex` finds it too); in a source checkout it is man/personaplex.1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import PersonaplexError

PAGE = "personaplex.1"


def page_path() -> Path | None:
    candidates = [Path(sys.prefix) / "share" / "man" / "man1" / PAGE,
                  Path(__file__).resolve().parents[2] / "man" / PAGE]
    return next((path for path in candidates if path.is_file()), None)


def help() -> None:  # noqa: A001 - the command's name
    """Show the manual page (all commands, options, files, exit statuses and examples)."""
    path = page_path()
    if path is None:
        raise PersonaplexError("the manual page is not installed with this copy of "
                               "personaplex; see `personaplex COMMAND --help`")
    if shutil.which("man"):
        sys.exit(subprocess.call(["man", "-l", str(path)]))
    for formatter in (["mandoc", "-Tutf8"], ["groff", "-man", "-Tutf8"]):
        if shutil.which(formatter[0]):
            text = subprocess.run([*formatter, str(path)], capture_output=True, text=True).stdout
            pager = os.environ.get("PAGER", "less -R") if sys.stdout.isatty() else None
            if pager and shutil.which(pager.split()[0]):
                subprocess.run(pager, shell=True, input=text, text=True)
            else:
                sys.stdout.write(text)
            return
    raise PersonaplexError(f"no manual viewer (man, mandoc or groff) is installed; the page "
                           f"is {path}")
