"""The README's newcomer flow through the real `mlxd` CLI against a daemon it starts itself,
with the packaged registry: run, a pull that fails (offline) and says what to do, list (pulled
and registered-not-pulled), show, ps, stop (twice), cp, rm; and the chat's slash commands."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mlxd.daemon import cli
from mlxd.daemon.client import Client
from mlxd.engine.backend import configure_backend
from tests.conftest import RunningServer, free_port
from tests.daemon.test_cli import _pids_with_env, _terminate, answers, cli_env, err, mlxd, out


@pytest.fixture
def newcomer(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """A fresh MLXD_HOME, the packaged registry, a free port, the hub offline."""
    port = free_port()
    marker = uuid.uuid4().hex
    home = tmp_path / "home"
    env = cli_env(port, MLXD_HOME=str(home), MLXD_TEST_MARKER=marker, HF_HUB_OFFLINE="1")
    try:
        yield env, home
    finally:
        for pid in set(_pids_with_env(f"MLXD_TEST_MARKER={marker}")):
            _terminate(pid)
        assert not answers(f"http://127.0.0.1:{port}")


def run(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    result = mlxd(list(args), 0, env=env)
    return result.returncode, out(result), err(result)


def rows(text: str) -> dict[str, str]:
    return {line.split()[0]: line for line in text.splitlines()[1:] if line.strip()}


def test_newcomer_flow(newcomer: tuple[dict[str, str], Path]) -> None:
    env, home = newcomer
    code, text, log = run(env, "run", "tiny", "def fib(n):")
    assert code == 0, log
    assert text.strip()
    assert "Starting the mlxd daemon" in log

    code, _, log = run(env, "pull", "qwen2.5-coder:7b")
    assert code == 1
    assert "HF_HUB_OFFLINE" in log and "hint:" in log and "local directory" in log

    code, text, log = run(env, "list")
    assert code == 0, log
    listed = rows(text)
    assert "ok" in listed["tiny:latest"]
    assert "not pulled (mlxd pull qwen2.5-coder:7b)" in listed["qwen2.5-coder:7b"]
    code, text, _ = run(env, "list", "--pulled")
    assert "qwen2.5-coder:7b" not in text and "tiny:latest" in text

    code, text, log = run(env, "show", "tiny")
    assert code == 0, log
    assert "architecture" in text and "completion" in text

    code, text, log = run(env, "ps")
    assert code == 0, log
    processor = "100% CPU" if configure_backend().device == "cpu" else "100% GPU"
    assert processor in rows(text)["tiny:latest"]

    code, _, log = run(env, "stop", "tiny")
    assert code == 0, log
    assert "tiny:latest" not in run(env, "ps")[1]
    code, _, log = run(env, "stop", "tiny")
    assert code == 0 and 'model "tiny" is not loaded' in log
    code, _, log = run(env, "stop", "nosuchmodel")
    assert code == 1 and 'couldn\'t find model "nosuchmodel" to stop' in log

    code, text, log = run(env, "cp", "tiny", "mytiny")
    assert code == 0, log
    written = yaml.safe_load((home / "models.yaml").read_text())["models"]["mytiny:latest"]
    assert written["target"] == "embedded:tiny/target"  # a name, not a path into the venv
    assert written["draft"] == "embedded:tiny/draft"
    code, text, log = run(env, "run", "mytiny", "hello")
    assert code == 0 and text.strip(), log

    code, text, log = run(env, "rm", "mytiny")
    assert code == 0 and "deleted 'mytiny'" in text, log
    assert "mytiny" not in run(env, "list")[1]


def test_chat_slash_commands(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = iter([
        "/set parameter num_predict 3",
        "/set parameter temperature abc",  # refused: never sent
        "/set parameter num_predict 8.5",
        "/set parameter warmth 1",
        "/set parameter stop <a> <b>",
        "/set system Answer briefly.",
        "/show parameters",
        "/show modelfile",
        "/show system",
        "/show info",
        "hello",
        "/load pair",
        "/show system",
        "/save mine",
        "/bye",
    ])  # fmt: skip

    def fake_input(prompt: str = "") -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    sent: list[dict[str, object]] = []
    client = Client(server.base_url)
    real_stream = client.stream

    def recording(path: str, body: dict[str, object]) -> Iterator[dict[str, object]]:
        sent.append(body)
        return real_stream(path, body)

    monkeypatch.setattr(client, "stream", recording)
    args = cli.parse_args(cli.build_parser(), ["run", "tiny"])
    try:
        assert cli.interactive(client, args, {}) == 0
    finally:
        client.close()
    shown = capsys.readouterr().out
    assert "Set parameter 'num_predict' to '3'" in shown
    assert "Couldn't set parameter: invalid value for parameter 'temperature': abc" in shown
    assert "Couldn't set parameter: invalid value for parameter 'num_predict': 8.5" in shown
    assert "Couldn't set parameter: unknown parameter 'warmth'" in shown
    assert "Set parameter 'stop' to '<a>, <b>'" in shown
    assert "Set system message." in shown
    assert "User defined parameters:" in shown and 'stop                           "<a>"' in shown
    assert 'SYSTEM """Answer briefly."""' in shown and "PARAMETER num_predict 3" in shown
    assert "Answer briefly." in shown
    assert "architecture" in shown  # /show info
    (turn,) = sent
    assert turn["options"] == {"num_predict": 3, "stop": ["<a>", "<b>"]}
    assert turn["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "hello"},
    ]
    assert "Loading model 'pair'" in shown
    assert "No system message was specified for this model." in shown  # /load resets
    # /save sends Ollama's create request; this server serves a fixed registry file
    assert "cannot create: the server reads its models from" in shown
