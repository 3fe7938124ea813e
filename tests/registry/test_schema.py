"""models.yaml v1: valid files load, every mistake names file, line, entry and key."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from mlxd.registry.schema import ModelEntry, RegistryError, load_registry_file

GOOD = """\
version: 1
models:
  qwen2.5-coder:7b:
    target: mlx-community/Qwen2.5-Coder-7B-Instruct-4bit
    draft: mlx-community/Qwen2.5-Coder-0.5B-Instruct-4bit
    draft_tokens: 3
    options:
      temperature: 0.2
      top_k: 20
      num_ctx: 8192
      stop: ["<|im_end|>", "<|endoftext|>"]
      use_mmap: false
      draft_method: lookup
    system: You are a careful programmer.
    template: "{{ .Prompt }}"
    context_length: 32768
    description: coder pair
  Me/Local:
    target: ./models/local
  other:
    target: ~/models/other
    options:
      stop: "</s>"
      temperature: 1
"""


def write(tmp_path: Path, text: str, name: str = "models.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_an_unquoted_off_turns_speculation_off(tmp_path: Path) -> None:
    """YAML reads `draft_method: off` as false; the entry means "off", as written."""
    text = "models:\n  coder:\n    target: x/y\n    options:\n      draft_method: off\n"
    entry = load_registry_file(write(tmp_path, text))["coder:latest"]
    assert entry.options["draft_method"] == "off"


def test_good_file(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    entries = load_registry_file(path)
    assert list(entries) == ["qwen2.5-coder:7b", "me/local:latest", "other:latest"]

    coder = entries["qwen2.5-coder:7b"]
    assert coder.name == "qwen2.5-coder:7b"
    assert coder.target == "mlx-community/Qwen2.5-Coder-7B-Instruct-4bit"
    assert coder.draft == "mlx-community/Qwen2.5-Coder-0.5B-Instruct-4bit"
    assert not coder.target_is_path
    assert coder.draft_tokens == 3
    assert dict(coder.options) == {
        "temperature": 0.2,
        "top_k": 20,
        "num_ctx": 8192,
        "stop": ("<|im_end|>", "<|endoftext|>"),
        "use_mmap": False,
        "draft_method": "lookup",
    }
    assert coder.system == "You are a careful programmer."
    assert coder.template == "{{ .Prompt }}"
    assert coder.context_length == 32768
    assert coder.description == "coder pair"
    assert coder.source == path.absolute()
    assert coder.line == 3

    local = entries["me/local:latest"]
    assert local.name == "Me/Local:latest"
    assert local.target == str(tmp_path / "models" / "local")
    assert local.target_is_path
    assert local.draft is None and local.draft_tokens is None
    assert local.line == 18

    other = entries["other:latest"]
    assert other.target == str(Path.home() / "models" / "other")
    assert other.options["stop"] == ("</s>",)
    assert other.options["temperature"] == 1.0
    assert isinstance(other.options["temperature"], float)


def test_options_are_read_only(tmp_path: Path) -> None:
    entry = load_registry_file(write(tmp_path, GOOD))["qwen2.5-coder:7b"]
    with pytest.raises(TypeError):
        entry.options["temperature"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        entry.target = "x"  # type: ignore[misc]


def test_entry_built_in_code_is_normalised() -> None:
    opts = {"temperature": 0.5}
    entry = ModelEntry(name="Tiny", target="/m", options=opts)
    opts["temperature"] = 9.0
    assert entry.name == "Tiny:latest" and entry.key == "tiny:latest"
    assert entry.options["temperature"] == 0.5


def test_relative_targets(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "gpt2").mkdir()
    path = write(
        tmp_path,
        """\
        models:
          a: {target: models/tiny}          # repo-id shaped, but the directory exists
          b: {target: org/not-here}         # repo-id shaped, no such directory: a repo id
          c: {target: ./x/../models/tiny}
          d: {target: ../elsewhere}
          e: {target: a/b/c}                # too many segments for a repo id
          f: {target: /abs/dir, draft: gpt2}
          g: {target: gpt2x}
        """,
    )
    e = load_registry_file(path)
    tiny = str(tmp_path / "models" / "tiny")
    assert e["a:latest"].target == tiny
    assert e["b:latest"].target == "org/not-here"
    assert e["c:latest"].target == tiny
    assert e["d:latest"].target == str(tmp_path.parent / "elsewhere")
    assert e["e:latest"].target == str(tmp_path / "a" / "b" / "c")
    assert e["f:latest"].target == "/abs/dir"
    assert e["f:latest"].draft == str(tmp_path / "gpt2")
    assert e["f:latest"].draft_is_path
    assert e["g:latest"].target == "gpt2x"


def test_relative_to_file_not_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sub = tmp_path / "conf"
    sub.mkdir()
    write(sub, "models:\n  m: {target: ./w}\n")
    monkeypatch.chdir(tmp_path)
    assert load_registry_file(Path("conf/models.yaml"))["m:latest"].target == str(sub / "w")


@pytest.mark.parametrize(
    "text",
    ["", "# only a comment\n", "models:\n", "version: 1\nmodels: {}\n"],
)
def test_empty_registries(tmp_path: Path, text: str) -> None:
    assert load_registry_file(write(tmp_path, text)) == {}


def test_merge_keys_and_anchors(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        models:
          a: &base
            target: org/a
            options: {temperature: 0.1}
          b:
            <<: *base
            draft: org/d
          c:
            <<: *base
            target: org/c
        """,
    )
    entries = load_registry_file(path)
    b = entries["b:latest"]
    assert b.target == "org/a" and b.draft == "org/d"
    assert b.options["temperature"] == 0.1
    assert entries["c:latest"].target == "org/c"  # a key written next to << overrides it


# (yaml body, line, entry, key, message regex): the message must name every part it knows.
BAD_CASES = [
    (
        "models:\n  coder:\n    target: x/y\n    draft_tokens: many\n",
        4,
        "coder",
        "draft_tokens",
        "expected a non-negative integer, got 'many'",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    draft_tokens: -1\n",
        4,
        "coder",
        "draft_tokens",
        "expected a non-negative integer, got -1",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    draft_tokens: true\n",
        4,
        "coder",
        "draft_tokens",
        "expected a non-negative integer, got true",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    context_length: 0\n",
        4,
        "coder",
        "context_length",
        "expected a positive integer, got 0",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    context_length: 1.5\n",
        4,
        "coder",
        "context_length",
        "expected a positive integer, got 1.5",
    ),
    (
        "models:\n  coder:\n    target: 12\n",
        3,
        "coder",
        "target",
        "expected a hub repo id or a directory path, got 12",
    ),
    (
        "models:\n  coder:\n    target: ''\n",
        3,
        "coder",
        "target",
        "expected a hub repo id or a directory path",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    draft: [a]\n",
        4,
        "coder",
        "draft",
        "expected a hub repo id or a directory path, got a list",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    system: {a: 1}\n",
        4,
        "coder",
        "system",
        "expected a string, got a mapping",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    template: 3\n",
        4,
        "coder",
        "template",
        "expected a string, got 3",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    description: null\n",
        4,
        "coder",
        "description",
        "expected a string, got null",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    drafts: a/b\n",
        4,
        "coder",
        "drafts",
        r"unknown key \(did you mean 'draft'\? expected one of: target, draft",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options: [1]\n",
        4,
        "coder",
        "options",
        "expected a mapping of option names to values, got a list",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options:\n      temprature: 1\n",
        5,
        "coder",
        "options.temprature",
        r"unknown option \(did you mean 'temperature'\?\)",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options:\n      temperature: hot\n",
        5,
        "coder",
        "options.temperature",
        "expected a number, got 'hot'",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options:\n      top_k: 1.5\n",
        5,
        "coder",
        "options.top_k",
        "expected an integer, got 1.5",
    ),
    (  # a value every request would be refused for is refused where it is written
        "models:\n  coder:\n    target: x/y\n    options:\n      min_p: 7\n",
        5,
        "coder",
        "options.min_p",
        "must be between 0 and 1",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options:\n      num_predict: -7\n",
        5,
        "coder",
        "options.num_predict",
        "must be -1, -2 or a count up to 2147483647",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options:\n      use_mmap: 1\n",
        5,
        "coder",
        "options.use_mmap",
        "expected true or false, got 1",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options:\n      draft_method: fast\n",
        5,
        "coder",
        "options.draft_method",
        "expected one of auto, model, lookup, forced, off, got 'fast'",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options:\n      stop: [a, 1]\n",
        5,
        "coder",
        "options.stop",
        "expected a string or a list of strings, got a list",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    options:\n      seed: 1\n      seed: 2\n",
        6,
        "coder",
        "options.seed",
        r"duplicate key \(first on line 5\)",
    ),
    (
        "models:\n  coder:\n    target: x/y\n    target: z/w\n",
        4,
        "coder",
        "target",
        r"duplicate key \(first on line 3\)",
    ),
]


@pytest.mark.parametrize(("body", "line", "entry", "key", "message"), BAD_CASES)
def test_bad_values(
    tmp_path: Path, body: str, line: int, entry: str, key: str, message: str
) -> None:
    path = write(tmp_path, body)
    with pytest.raises(RegistryError) as info:
        load_registry_file(path)
    text = str(info.value)
    prefix = f"{path.absolute()}:{line}: entry '{entry}': key '{key}': "
    assert text.startswith(prefix), text
    assert re.search(message, text[len(prefix) :]), text


def test_message_format_matches_docs(tmp_path: Path) -> None:
    body = "models:\n" + "\n" * 8 + "  coder:\n    target: a/b\n    draft_tokens: many\n"
    path = write(tmp_path, body)
    with pytest.raises(RegistryError) as info:
        load_registry_file(path)
    assert str(info.value) == (
        f"{path.absolute()}:12: entry 'coder': key 'draft_tokens': "
        "expected a non-negative integer, got 'many'"
    )


# (yaml body, line, message regex) for errors above or at the entry level.
STRUCTURE_CASES = [
    ("models:\n  coder: {}\n", 2, r"entry 'coder': missing required key 'target'$"),
    (
        "models:\n  coder:\n",
        2,
        r"entry 'coder': expected a mapping with at least 'target', got nothing",
    ),
    ("models:\n  coder: org/repo\n", 2, r"entry 'coder': expected a mapping .* got 'org/repo'"),
    ("models:\n  bad name:\n    target: x\n", 2, r"entry 'bad name': invalid model name$"),
    ("models:\n  a/b/c/d:\n    target: x\n", 2, r"entry 'a/b/c/d': invalid model name$"),
    ("models: [a]\n", 1, r"key 'models': expected a mapping of model names to entries, got a list"),
    ("version: 2\nmodels: {}\n", 1, r"key 'version': unsupported schema version 2 \(expected 1\)"),
    ("version: '1'\nmodels: {}\n", 1, r"key 'version': unsupported schema version '1'"),
    ("modles: {}\n", 1, r"key 'modles': unknown top-level key"),
    ("- a\n- b\n", 1, r"expected a mapping with a 'models' key"),
    ("version: 1\n", 1, r"missing required key 'models'"),
    ("models: {}\nmodels: {}\n", 2, r"key 'models': duplicate key \(first on line 1\)"),
    (
        "models:\n  Coder:\n    target: a/b\n  coder:latest:\n    target: c/d\n",
        4,
        r"entry 'coder:latest': duplicate model name \(same as 'Coder:latest' on line 2\)",
    ),
    (
        "models:\n  c:\n    target: a/b\n  c:\n    target: c/d\n",
        4,
        r"entry 'c': duplicate model name",
    ),
    ("models:\n  ~:\n    target: a/b\n", 2, r"expected a plain string key"),
]


@pytest.mark.parametrize(("body", "line", "message"), STRUCTURE_CASES)
def test_bad_structure(tmp_path: Path, body: str, line: int, message: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(RegistryError) as info:
        load_registry_file(path)
    text = str(info.value)
    assert text.startswith(f"{path.absolute()}:{line}: "), text
    assert re.search(message, text), text


@pytest.mark.parametrize(
    ("body", "line"),
    [
        ("models:\n  a:\n    target: [unclosed\n", 4),
        ("models:\n  a:\n   target: x\n  b: : :\n", 4),
        ("models:\n\ta: 1\n", 2),
        ("models: {}\n---\nmodels: {}\n", 2),
        ("models:\n  a: *nope\n", 2),
    ],
)
def test_invalid_yaml_reports_line(tmp_path: Path, body: str, line: int) -> None:
    path = write(tmp_path, body)
    with pytest.raises(
        RegistryError, match=rf"^{re.escape(str(path.absolute()))}:{line}: invalid YAML: "
    ):
        load_registry_file(path)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="cannot read registry file"):
        load_registry_file(tmp_path / "absent.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"models:\n  caf\xe9: {target: a/b}\n")
    with pytest.raises(RegistryError, match="not UTF-8"):
        load_registry_file(bad)


def test_registry_error_is_value_error() -> None:
    assert issubclass(RegistryError, ValueError)


def test_packaged_registry_is_valid() -> None:
    packaged = Path(__file__).resolve().parents[2] / "models.yaml"
    entries = load_registry_file(packaged)
    coder = entries["qwen2.5-coder:7b"]
    assert coder.target == "mlx-community/Qwen2.5-Coder-7B-Instruct-4bit"
    assert coder.draft == "mlx-community/Qwen2.5-Coder-0.5B-Instruct-4bit"
    assert coder.draft_tokens == 3
    assert {"qwen2.5:7b", "llama3.2:3b"} <= set(entries)
