"""Daemon settings from the environment: OLLAMA_HOST rules, MLXD_ precedence, keep-alive."""

from __future__ import annotations

import math

import pytest

from mlxd.api.durations import DurationError, env_keep_alive, parse_go_duration, parse_keep_alive
from mlxd.daemon.config import (
    DEFAULT_PORT,
    ConfigError,
    Settings,
    client_base_url,
    env,
    parse_bytes,
    parse_host,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ("127.0.0.1", 11434)),
        ("", ("127.0.0.1", 11434)),
        ("example.com", ("example.com", 11434)),
        ("1.2.3.4", ("1.2.3.4", 11434)),
        ("http://example.com", ("example.com", 80)),
        ("https://example.com", ("example.com", 443)),
        ("HTTP://example.com", ("example.com", 80)),
        ("http://example.com:8080", ("example.com", 8080)),
        ("https://example.com:8443/some/path", ("example.com", 8443)),
        ("0.0.0.0:1234", ("0.0.0.0", 1234)),
        ("0.0.0.0", ("0.0.0.0", 11434)),
        ("127.0.0.1:5000", ("127.0.0.1", 5000)),
        ("[::1]:5000", ("::1", 5000)),
        ("http://[::1]", ("::1", 80)),
        ("  localhost:7000  ", ("localhost", 7000)),
        ("::1", ("::1", 11434)),  # a bare IPv6 address, as Ollama takes it
        ("::", ("::", 11434)),
        ("http://::1", ("::1", 80)),
        (":8080", ("0.0.0.0", 8080)),  # no host: every interface, as Ollama listens on `:PORT`
        ("http://:8080", ("0.0.0.0", 8080)),
    ],
)
def test_parse_host(value: str | None, expected: tuple[str, int]) -> None:
    assert parse_host(value) == expected


@pytest.mark.parametrize("value", ["example.com:notaport", "example.com:99999", "fe80::1::2"])
def test_parse_host_bad_port(value: str) -> None:
    with pytest.raises(ConfigError):
        parse_host(value)


@pytest.mark.parametrize("value", ["1.2.3", ".", "1..5GB", "..", "1.2.3GiB"])
def test_a_malformed_size_is_a_config_error(value: str) -> None:
    """Not a traceback from float(): `mlxd serve` prints the error line it prints for any
    setting it cannot read."""
    with pytest.raises(ConfigError, match="invalid size"):
        Settings.from_env({"MLXD_CACHE_RAM": value})


@pytest.mark.parametrize(
    ("value", "expected"), [("1.5GB", 1_500_000_000), (".5GiB", 2**29), ("3.", 3)]
)
def test_sizes_with_a_decimal_point(value: str, expected: int) -> None:
    assert parse_bytes(value) == expected


def test_default_port_constant() -> None:
    assert DEFAULT_PORT == 11434


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "http://127.0.0.1:11434"),
        ({"MLXD_HOST": "0.0.0.0:1234"}, "http://127.0.0.1:1234"),
        ({"MLXD_HOST": "0.0.0.0"}, "http://127.0.0.1:11434"),
        ({"OLLAMA_HOST": "0.0.0.0:5555"}, "http://127.0.0.1:5555"),
        ({"MLXD_HOST": "[::]:5000"}, "http://127.0.0.1:5000"),
        ({"MLXD_HOST": "[::1]:5000"}, "http://[::1]:5000"),
        ({"MLXD_HOST": "example.com"}, "http://example.com:11434"),
        ({"MLXD_HOST": "http://example.com"}, "http://example.com:80"),
    ],
)
def test_client_base_url(environ: dict[str, str], expected: str) -> None:
    assert client_base_url(environ) == expected


def test_client_base_url_keeps_https() -> None:
    assert client_base_url({"MLXD_HOST": "https://example.com"}).startswith("https://")


def test_mlxd_host_wins_over_ollama_host() -> None:
    both = {"MLXD_HOST": "127.0.0.1:2000", "OLLAMA_HOST": "127.0.0.1:3000"}
    assert client_base_url(both) == "http://127.0.0.1:2000"
    assert Settings.from_env(both).port == 2000
    assert Settings.from_env({"OLLAMA_HOST": "127.0.0.1:3000"}).port == 3000


def test_blank_mlxd_host_falls_back_to_ollama_host() -> None:
    environ = {"MLXD_HOST": "  ", "OLLAMA_HOST": "127.0.0.1:3000"}
    assert Settings.from_env(environ).port == 3000


def test_env_trims_spaces_and_quotes() -> None:
    assert env({"OLLAMA_HOST": ' "1.2.3.4:5" '}, "HOST") == "1.2.3.4:5"
    assert env({"MLXD_KEEP_ALIVE": "'10m'"}, "KEEP_ALIVE") == "10m"
    assert env({"MLXD_HOST": '""'}, "HOST") is None
    assert env({}, "HOST") is None


def test_settings_defaults() -> None:
    s = Settings.from_env({})
    assert (s.host, s.port) == ("127.0.0.1", 11434)
    assert s.keep_alive == 300.0
    assert s.max_loaded == 3
    assert s.registry is None
    assert s.adapter_bytes is None  # the engine's 2 GiB
    assert Settings.from_env({"MLXD_ADAPTER_BYTES": "512MB"}).adapter_bytes == 512 * 10**6


def test_settings_bind_all_interfaces() -> None:
    s = Settings.from_env({"OLLAMA_HOST": "0.0.0.0:1234"})
    assert (s.host, s.port) == ("0.0.0.0", 1234)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("600", 600.0),
        ("0", 0.0),
        ("10m", 600.0),
        ("1h30m", 5400.0),
        ("24h", 86400.0),
        ("1.5s", 1.5),
        ('"5m"', 300.0),
        ("-1", math.inf),
        ("-1m", math.inf),
        ("-5", math.inf),
    ],
)
def test_keep_alive_env(value: str, seconds: float) -> None:
    assert Settings.from_env({"OLLAMA_KEEP_ALIVE": value}).keep_alive == seconds
    assert Settings.from_env({"MLXD_KEEP_ALIVE": value}).keep_alive == seconds
    if value.strip('"'):
        assert env_keep_alive(value.strip('"')) == seconds


def test_mlxd_keep_alive_wins() -> None:
    environ = {"MLXD_KEEP_ALIVE": "1m", "OLLAMA_KEEP_ALIVE": "1h"}
    assert Settings.from_env(environ).keep_alive == 60.0


def test_env_keep_alive_default() -> None:
    assert env_keep_alive(None) == 300.0
    assert env_keep_alive("") == 300.0
    assert env_keep_alive(None, default=7.0) == 7.0


def test_bad_keep_alive_env_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Settings.from_env({"MLXD_KEEP_ALIVE": "soon"})


def test_bad_keep_alive_env_raises() -> None:
    with pytest.raises(ValueError):
        Settings.from_env({"MLXD_KEEP_ALIVE": "soon"})


@pytest.mark.parametrize(("value", "loaded"), [("2", 2), ("0", 3), (None, 3), ("-1", 3)])
def test_max_loaded_models(value: str | None, loaded: int) -> None:
    environ = {} if value is None else {"OLLAMA_MAX_LOADED_MODELS": value}
    assert Settings.from_env(environ).max_loaded == loaded


def test_max_loaded_models_invalid() -> None:
    with pytest.raises(ConfigError):
        Settings.from_env({"MLXD_MAX_LOADED_MODELS": "lots"})


# -- request keep_alive (api.durations), which the daemon's env parsing builds on ------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (3600, 3600.0),
        (1.5, 1.5),
        ("10m", 600.0),
        ("0", 0.0),
        ("1h30m", 5400.0),
        ("500ms", 0.5),
        (-1, math.inf),
        ("-1m", math.inf),
    ],
)
def test_parse_keep_alive(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["3600", "5x", "m", "", True, [1], {"a": 1}])
def test_parse_keep_alive_errors(value: object) -> None:
    with pytest.raises(DurationError):
        parse_keep_alive(value)


def test_missing_unit_message_matches_go() -> None:
    with pytest.raises(DurationError, match=r'^time: missing unit in duration "3600"$'):
        parse_go_duration("3600")


def test_runner_stall_limit() -> None:
    assert Settings.from_env({}).runner_stall_s == 120.0
    assert Settings.from_env({"MLXD_RUNNER_STALL_S": "2.5"}).runner_stall_s == 2.5
    assert Settings.from_env({"MLXD_RUNNER_STALL_S": "0"}).runner_stall_s == 0.0  # off
    with pytest.raises(ConfigError):
        Settings.from_env({"MLXD_RUNNER_STALL_S": "soon"})


@pytest.mark.parametrize("value", ["1e18", "nan", "99999999999h"])
def test_keep_alive_env_past_gos_range_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError):
        Settings.from_env({"MLXD_KEEP_ALIVE": value})


def test_max_body_env() -> None:
    assert Settings.from_env({}).max_body == 32 * 2**20
    assert Settings.from_env({"MLXD_MAX_BODY": "1MiB"}).max_body == 2**20
    assert Settings.from_env({"MLXD_MAX_BODY": "4096"}).max_body == 4096
    for bad in ("0", "lots"):
        with pytest.raises(ConfigError):
            Settings.from_env({"MLXD_MAX_BODY": bad})
