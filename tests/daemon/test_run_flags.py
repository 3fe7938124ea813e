"""`mlxd` flags anywhere after the subcommand, as Ollama's CLI takes them: parsed in process for
every subcommand, then `mlxd run` with flags before and after the prompt against a real server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.daemon import cli
from tests.conftest import RunningServer, ServerThread
from tests.daemon.test_cli import api_generate, err, mlxd, out
from tests.fixtures.tiny_models import TinyPair


def parse(*argv: str) -> dict[str, Any]:
    fields = vars(cli.parse_args(cli.build_parser(), argv))
    fields.pop("func", None)
    return fields


RUN_DEFAULTS = {"verbose": False, "keepalive": None, "format": None, "nowordwrap": False,
                "think": None}  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "tiny", "--verbose", "def f(", "--keepalive", "5m"],
        ["run", "--verbose", "tiny", "def f(", "--keepalive=5m"],
        ["run", "tiny", "def f(", "--verbose", "--keepalive", "5m"],
        ["run", "--keepalive", "5m", "--verbose", "tiny", "def f("],
    ],
)
def test_run_flags_before_between_and_after(argv: list[str]) -> None:
    fields = parse(*argv)
    assert fields["model"] == "tiny"
    assert fields["prompt"] == ["def f("]
    assert fields["verbose"] is True and fields["keepalive"] == "5m"


def test_run_prompt_words_keep_their_order_around_flags() -> None:
    fields = parse("run", "tiny", "tell", "--verbose", "me", "--nowordwrap", "a", "story")
    assert fields["prompt"] == ["tell", "me", "a", "story"]
    assert fields["verbose"] and fields["nowordwrap"]


def test_run_all_flags() -> None:
    fields = parse("run", "tiny", "hi", "--format", "json", "--think=high", "--nowordwrap")
    assert {k: fields[k] for k in RUN_DEFAULTS} == {
        **RUN_DEFAULTS, "format": "json", "think": "high", "nowordwrap": True,
    }  # fmt: skip


@pytest.mark.parametrize("value", ["-1m", "-1", "0"])
def test_keepalive_takes_the_next_word_even_with_a_dash(value: str) -> None:
    """`--keepalive -1m` (keep loaded forever), as Ollama's CLI takes it."""
    fields = parse("run", "tiny", "--keepalive", value, "hi")
    assert fields["keepalive"] == value and fields["prompt"] == ["hi"]


def test_bare_think_is_true_and_never_takes_the_next_word() -> None:
    fields = parse("run", "tiny", "--think", "why")
    assert fields["think"] == "true" and fields["prompt"] == ["why"]


def test_double_dash_ends_the_flags() -> None:
    fields = parse("run", "tiny", "--", "--verbose", "--think")
    assert fields["prompt"] == ["--verbose", "--think"]
    assert fields["verbose"] is False and fields["think"] is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-v"], {"version": True}),
        (["list"], {"command": "list"}),
        (["ls"], {"command": "ls"}),
        (["ps"], {"command": "ps"}),
        (["serve", "--registry", "r.yaml"], {"command": "serve", "registry": "r.yaml"}),
        (["start"], {"command": "start", "registry": None}),
        (["show", "--modelfile", "tiny"], {"model": "tiny", "modelfile": True}),
        (["show", "tiny", "--system"], {"model": "tiny", "system": True}),
        (["stop", "tiny"], {"model": "tiny"}),
        (["pull", "org/repo", "--insecure"], {"model": "org/repo", "insecure": True}),
        (["pull", "--insecure", "org/repo"], {"model": "org/repo", "insecure": True}),
        (["rm", "a", "b"], {"models": ["a", "b"]}),
        (["cp", "a", "b"], {"source": "a", "destination": "b"}),
    ],
)
def test_every_subcommand_parses(argv: list[str], expected: dict[str, Any]) -> None:
    fields = parse(*argv)
    if "registry" in fields and fields["registry"] is not None:
        fields["registry"] = str(fields["registry"])
    assert {k: fields[k] for k in expected} == expected


@pytest.mark.parametrize(
    "argv", [["run"], ["run", "tiny", "--bogus"], ["show"], ["cp", "a"], ["nope"], ["rm"]]
)
def test_bad_command_lines_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2


@pytest.mark.parametrize(
    ("flags", "fields"),
    [
        ({}, {}),
        ({"keepalive": "1m"}, {"keep_alive": "1m"}),
        ({"format": "json"}, {"format": "json"}),
        ({"format": '{"type": "object"}'}, {"format": {"type": "object"}}),
        ({"format": "yaml"}, {"format": "yaml"}),
        ({"think": "true"}, {"think": True}),
        ({"think": "false"}, {"think": False}),
        ({"think": "high"}, {"think": "high"}),
    ],
)
def test_run_fields(flags: dict[str, str], fields: dict[str, Any]) -> None:
    args = argparse.Namespace(**{**RUN_DEFAULTS, **flags})
    assert cli.run_fields(args) == fields


# -- against a real server ---------------------------------------------------------------------


def test_flags_after_the_prompt(server: RunningServer) -> None:
    result = mlxd(["run", "sys", "hi", "--verbose", "--nowordwrap", "--think=false"], server.port)
    assert result.returncode == 0, err(result)
    assert out(result) == api_generate(server, "hi")["response"] + "\n"
    assert "eval count:" in err(result)


def test_format_json_prints_a_json_object(tiny_pair: TinyPair, tmp_path: Path) -> None:
    registry = tmp_path / "models.yaml"
    registry.write_text(
        f"models:\n  greedy:\n    target: {tiny_pair.target}\n"
        "    options:\n      temperature: 0\n      num_predict: 200\n",
        encoding="utf-8",
    )
    schema = '{"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},'
    schema += ' "required": ["n"], "additionalProperties": false}'
    with ServerThread(registry) as server:
        for flags in (["--format", "json"], ["--format", schema]):
            result = mlxd(["run", "greedy", "Give me JSON", *flags], server.port)
            assert result.returncode == 0, err(result)
            value = json.loads(out(result))
            assert isinstance(value, dict)
            if flags[1] != "json":
                assert set(value) == {"n"} and isinstance(value["n"], int)


def test_keepalive_after_the_prompt_reaches_the_server(server: RunningServer) -> None:
    result = mlxd(["run", "tiny", "hi", "--keepalive", "0"], server.port)
    assert result.returncode == 0, err(result)
    loaded = {m["name"] for m in httpx.get(f"{server.base_url}/api/ps").json()["models"]}
    assert "tiny:latest" not in loaded  # keep_alive 0: unloaded as soon as it answered


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--format", '{"type": "nope"}'], "invalid json schema: Invalid type: nope"),
        (["--think"], '"sys:latest" does not support thinking'),
        (["--think=sometimes"], "invalid think value"),
    ],
)
def test_refused_flags_show_the_servers_error(
    server: RunningServer, flags: list[str], message: str
) -> None:
    result = mlxd(["run", "sys", "hi", *flags], server.port)
    assert result.returncode == 1
    assert f"Error: {message}" in err(result)
    assert "Traceback" not in err(result)
    assert out(result) == ""
