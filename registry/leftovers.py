"""What a killed process leaves in ``$MLXD_HOME``: the temporary files that registry edits,
the digest cache and blob uploads write before they rename them into place, and the adapter
directories a create builds beside their final names. Each one's name carries the writer's
process id; one whose writer is gone is removed when the daemon starts (an upload's partial
file can be as large as the upload). A writer still running (another daemon sharing the
home) keeps its files."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

__all__ = ["sweep_leftovers", "writer_running"]

# (folder under the home, name pattern whose group 1 is the writer's pid)
LEFTOVERS = (
    ("", re.compile(r"^\..+\.(\d+)\.\d+\.tmp$")),  # models.yaml, digests.json
    ("blobs", re.compile(r"^\.sha256-[0-9a-f]{64}\.(\d+)\.\d+\.partial$")),
    ("adapters", re.compile(r"^\.[0-9a-f]{64}\.(\d+)\.partial$")),
    ("probes", re.compile(r"^\..+\.(\d+)\.tmp$")),  # a load's measured costs
)


def writer_running(pid: int) -> bool:
    """Whether process `pid` (a file's writer, by the pid in its name) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # not ours to signal: running
        return True
    return True


def sweep_leftovers(home: Path) -> int:
    """Remove what writers that are no longer running left under `home`; how many."""
    removed = 0
    for folder, pattern in LEFTOVERS:
        try:
            names = os.listdir(home / folder)
        except OSError:
            continue
        for name in names:
            match = pattern.match(name)
            if match is None or writer_running(int(match.group(1))):
                continue
            path = home / folder / name
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed += 1
    return removed
