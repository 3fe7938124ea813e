"""`mlxd serve` configures the backend (the CPU BLAS under MLX) before anything imports MLX:
importing the CLI must not import it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_cli_leaves_mlx_unimported() -> None:
    code = "import sys, mlxd.daemon.cli; print('mlx.core' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
