"""`mlxd serve` configures the backend before MLX is imported; the CLI's own imports (settings,
the client) must therefore not import MLX, or the CPU BLAS cannot be put under it."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_does_not_import_mlx() -> None:
    code = "import sys, mlxd.daemon.cli; print('mlx.core' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
