"""`mlxd pull`, `rm`, `cp` and `run`'s automatic pull, as subprocesses against a real server."""

from __future__ import annotations

import io
import re

import httpx

from mlxd.daemon.cli import PullProgress
from mlxd.registry.store import resolve_local
from tests.conftest import RunningServer
from tests.pull.conftest import TARGET_REPO, HubEnv, cli

BAR = re.compile(r"^pulling [0-9a-f]{12}: +(\d+)% ")


def tags(server: RunningServer) -> list[str]:
    return [m["name"] for m in httpx.get(f"{server.base_url}/api/tags").json()["models"]]


def test_pull_prints_progress(mlxd: RunningServer, hub_env: HubEnv) -> None:
    result = cli(["pull", "hf.co/org/tiny"], mlxd)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == "pulling manifest"
    assert lines[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    bars = [line for line in lines if BAR.match(line)]
    done = {line.split(":")[0] for line in bars if BAR.match(line).group(1) == "100"}  # type: ignore[union-attr]
    assert len(done) == 6  # one finished line per file
    assert any(line.endswith("396.5 KB") for line in bars)  # the weights' size
    assert "hf.co/org/tiny:latest" in tags(mlxd)


def test_pull_errors(mlxd: RunningServer, hub_env: HubEnv) -> None:
    result = cli(["pull", "org/nope"], mlxd)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "pulling manifest",
        "Error: pull model manifest: file does not exist",
        "  hint: no such model: `mlxd list` shows the registered names; any MLX repo on the hub"
        " pulls as org/repo or hf.co/org/repo[:revision]",
    ]


def test_cp_and_rm(mlxd: RunningServer, hub_env: HubEnv) -> None:
    assert cli(["pull", "org/tiny"], mlxd).returncode == 0
    result = cli(["cp", "hf.co/org/tiny", "mine"], mlxd)
    assert (result.returncode, result.stdout) == (0, "copied 'hf.co/org/tiny' to 'mine'\n")
    assert "mine:latest" in tags(mlxd)

    result = cli(["rm", "mine", "hf.co/org/tiny"], mlxd)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "deleted 'mine'\ndeleted 'hf.co/org/tiny'\n"
    assert not {"mine:latest", "hf.co/org/tiny:latest"} & set(tags(mlxd))

    result = cli(["rm", "mine"], mlxd)
    assert (result.returncode, result.stderr) == (1, "Error: model 'mine' not found\n")
    result = cli(["cp", "nope", "other"], mlxd)
    assert (result.returncode, result.stderr) == (1, 'Error: model "nope" not found\n')


def test_run_pulls_a_registered_model_first(mlxd_fixed: RunningServer, hub_env: HubEnv) -> None:
    """`hubtiny` is in the server's --registry file but only on the hub: run pulls, then answers
    with the entry's options (num_predict 8, temperature 0)."""
    assert "hubtiny:latest" not in tags(mlxd_fixed)
    result = cli(["run", "hubtiny", "Why is the sky blue?"], mlxd_fixed)
    assert result.returncode == 0, result.stderr
    assert "pulling manifest" in result.stderr and "success" in result.stderr
    assert result.stdout.strip()
    assert resolve_local(TARGET_REPO) is not None
    assert "hubtiny:latest" in tags(mlxd_fixed)

    again = cli(["run", "hubtiny", "Why is the sky blue?"], mlxd_fixed)
    assert again.returncode == 0 and "pulling" not in again.stderr
    assert again.stdout == result.stdout  # greedy: the same eight tokens


def test_run_pulls_a_hub_repo_by_its_short_name(mlxd: RunningServer, hub_env: HubEnv) -> None:
    result = cli(["run", "org/tiny", "hello", "--verbose"], mlxd)
    assert result.returncode == 0, result.stderr
    assert "success" in result.stderr and "eval count:" in result.stderr
    assert result.stdout.strip()
    assert "hf.co/org/tiny:latest" in tags(mlxd)


def progress(letter: str, total: int, completed: int = 0) -> dict[str, object]:
    obj: dict[str, object] = {
        "status": f"pulling {letter * 12}",
        "digest": "sha256:" + letter * 64,
        "total": total,
    }
    if completed:
        obj["completed"] = completed
    return obj


def test_progress_bars_on_a_terminal() -> None:
    out = io.StringIO()
    bars = PullProgress(out, tty=True)
    for obj in (
        {"status": "pulling manifest"},
        progress("a", 2000),
        progress("a", 2000, 1000),
        progress("a", 2000, 2000),
        progress("b", 10, 10),
        {"status": "success"},
    ):
        bars.update(obj)
    bars.close()
    lines = out.getvalue().split("\n")
    assert lines[0] == "pulling manifest"
    redraws = lines[1].split("\r")[1:]  # one line, redrawn in place
    assert [r.split("%")[0][-3:] for r in redraws] == ["  0", " 50", "100"]
    assert "▕████████████▏" not in redraws[0] and "1.0 KB/2.0 KB" in redraws[1]
    assert redraws[2].startswith(
        "pulling aaaaaaaaaaaa: 100% ▕" + "█" * PullProgress.WIDTH + "▏ 2.0 KB"
    )
    assert lines[2].startswith("\rpulling bbbbbbbbbbbb: 100%")
    assert lines[3:] == ["success", ""]


def test_plain_progress_is_short() -> None:
    out = io.StringIO()
    bars = PullProgress(out, tty=False)
    for done in range(0, 1001, 5):
        bars.update(progress("c", 1000, done))
    lines = out.getvalue().splitlines()
    assert [int(BAR.match(line).group(1)) for line in lines] == list(range(0, 101, 10))  # type: ignore[union-attr]
