"""Ollama name parsing: part rules, defaults and DisplayShortest."""

from __future__ import annotations

import pytest

from mlxd.registry.names import InvalidModelName, ModelName, parse_name


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("llama3.2", ModelName("registry.ollama.ai", "library", "llama3.2", "latest")),
        ("llama3.2:3b", ModelName("registry.ollama.ai", "library", "llama3.2", "3b")),
        ("me/m", ModelName("registry.ollama.ai", "me", "m", "latest")),
        ("me/m:v1.0", ModelName("registry.ollama.ai", "me", "m", "v1.0")),
        ("hf.co/org/repo:Q4_K_M", ModelName("hf.co", "org", "repo", "Q4_K_M")),
        (
            "hf.co/bartowski/Llama-3.2-1B-GGUF",
            ModelName("hf.co", "bartowski", "Llama-3.2-1B-GGUF", "latest"),
        ),
        ("localhost:5000/ns/m:t", ModelName("localhost:5000", "ns", "m", "t")),
        ("https://example.com/ns/m:t", ModelName("example.com", "ns", "m", "t")),
        ("qwen2.5-coder:7b", ModelName("registry.ollama.ai", "library", "qwen2.5-coder", "7b")),
        ("_x/_y:_z", ModelName("registry.ollama.ai", "_x", "_y", "_z")),
        ("a" * 80 + ":" + "b" * 80, ModelName("registry.ollama.ai", "library", "a" * 80, "b" * 80)),
        ("h" * 350 + "/n/m", ModelName("h" * 350, "n", "m", "latest")),
    ],
)
def test_parse_valid(raw: str, expected: ModelName) -> None:
    assert parse_name(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        "",
        ":",
        "model:",
        ":tag",
        "/model",
        "ns/",
        "a/b/c/d",
        "-model",
        ".model",
        "model:-tag",
        "mo del",
        "model@sha256:abc",
        "ns.dots/model",  # namespace may not contain dots
        "ns/mo:del:x/y",  # a ':' before the last '/' puts a tag-ish part in the model
        "host/ns/mo:del/x",
        "a" * 81,
        "m:" + "t" * 81,
        "n" * 81 + "/m",
        "h" * 351 + "/n/m",
        "https://model",
        "1https://h/n/m",
        "ünïcode",
    ],
)
def test_parse_invalid(raw: str) -> None:
    with pytest.raises(InvalidModelName, match=r"^invalid model name$"):
        parse_name(raw)


def test_invalid_is_value_error() -> None:
    with pytest.raises(ValueError):
        parse_name("bad name")


@pytest.mark.parametrize(
    ("raw", "display"),
    [
        ("llama3.2", "llama3.2:latest"),
        ("me/m", "me/m:latest"),
        ("library/m:t", "m:t"),
        ("registry.ollama.ai/library/m", "m:latest"),
        ("REGISTRY.ollama.ai/Library/M:T", "M:T"),
        ("registry.ollama.ai/me/m", "me/m:latest"),
        ("hf.co/org/repo:Q4", "hf.co/org/repo:Q4"),
        ("other.host/library/m", "other.host/library/m:latest"),
    ],
)
def test_display(raw: str, display: str) -> None:
    assert parse_name(raw).display == display
    assert str(parse_name(raw)) == display


def test_key_is_case_insensitive() -> None:
    assert parse_name("Llama3.2:3B").key == parse_name("llama3.2:3b").key == "llama3.2:3b"
    assert parse_name("HF.co/Org/Repo:Q4").key == "hf.co/org/repo:q4"
    assert parse_name("Llama3.2:3B").display == "Llama3.2:3B"


def test_full_name() -> None:
    assert parse_name("m").full == "registry.ollama.ai/library/m:latest"


def test_frozen() -> None:
    name = parse_name("m")
    with pytest.raises(AttributeError):
        name.tag = "x"  # type: ignore[misc]
