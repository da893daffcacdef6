"""What a killed process leaves behind while it writes something whole (a cache entry, the CLI's output, a
conversion), and its removal by a later run.

Each writer stages its work under names of one pattern and renames it into place; an interrupt or SIGTERM removes
the stage, but SIGKILL and the kernel's OOM killer skip every cleanup. A later run in the same folder removes staged
files older than any live writer could be working on them.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

# A staged file older than this is a dead writer's: a whole entry or output is written in seconds.
STALE_SECONDS = 3600


def remove_stale(folder: str | Path, pattern: str, seconds: float = STALE_SECONDS) -> None:
    """Remove what matches `pattern` (a glob) in `folder` and was last changed more than `seconds` ago; a folder
    missing or unreadable, or an entry another process removes first, is no error."""
    cutoff = time.time() - seconds
    with contextlib.suppress(OSError):
        for path in Path(folder).glob(pattern):
            with contextlib.suppress(OSError):
                if path.lstat().st_mtime >= cutoff:
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
