"""The registry side of adapters, without a model: the `adapters:` key, reading and checking
adapter files against a base's headers, and Modelfile text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mlxd.engine.adapters import AdapterError, load_adapters
from mlxd.registry.adapterfiles import (
    AdapterFileError,
    AdapterInfo,
    adapter_revision,
    check_fits,
    check_layout,
    read_adapter,
)
from mlxd.registry.modelfile import ModelfileError, parse_modelfile, render_modelfile
from mlxd.registry.schema import AdapterRef, RegistryError, load_registry_file
from mlxd.registry.store import read_safetensors_header
from tests.adapters.conftest import Adapters
from tests.fixtures.tiny_models import TinyPair


def registry(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  m:\n    target: /base\n{body}", encoding="utf-8")
    return path


def test_adapters_key_takes_a_path_a_list_or_path_and_scale(tmp_path: Path) -> None:
    one = load_registry_file(registry(tmp_path, "    adapters: ./a\n"))["m:latest"]
    assert one.adapters == (AdapterRef(str(tmp_path / "a")),)
    many = load_registry_file(
        registry(tmp_path, "    adapters: [/x, {path: /y, scale: 2}]\n    draft_adapters: /z\n")
    )["m:latest"]
    assert many.adapters == (AdapterRef("/x"), AdapterRef("/y", 2.0))
    assert many.draft_adapters == (AdapterRef("/z"),)
    assert many.load_key == one.load_key  # adapters never change what is loaded
    go = load_registry_file(registry(tmp_path, "    template: '{{ .Prompt }}'\n"))["m:latest"]
    assert go.load_key == one.load_key  # an Ollama template is rendered per request
    jinja = load_registry_file(registry(tmp_path, "    template: '{{ messages }}'\n"))["m:latest"]
    assert jinja.load_key != one.load_key  # a Jinja one is what the tokenizer is loaded with
    for bad in (
        "{scale: 2}", "[{path: /y, scale: lots}]", "[{path: /y, rank: 2}]", "3",
        "[{path: /y, scale: .nan}]", "[{path: /y, scale: -.inf}]",
    ):  # fmt: skip
        with pytest.raises(RegistryError, match="key 'adapters'"):
            load_registry_file(registry(tmp_path, f"    adapters: {bad}\n"))


def test_adapter_files_are_read_and_checked_against_the_base(
    adapters: Adapters, tiny_pair: TinyPair, tmp_path: Path
) -> None:
    info = read_adapter(adapters.sql)
    assert info.kind == "lora" and info.rank == 4 and info.scale == 10.0
    assert read_adapter(adapters.dora).dora
    check_fits(info, tiny_pair.target)
    check_fits(read_adapter(adapters.draft), tiny_pair.draft)
    with pytest.raises(AdapterFileError, match="does not fit"):
        check_fits(read_adapter(adapters.other_base), tiny_pair.target)
    full = tmp_path / "full"
    shutil.copytree(adapters.sql, full)
    config = json.loads((full / "adapter_config.json").read_text())
    (full / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "full"}))
    with pytest.raises(AdapterFileError, match="cannot be mounted"):
        read_adapter(full)
    (full / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterFileError, match="not valid JSON"):
        read_adapter(full)
    (full / "adapter_config.json").unlink()
    with pytest.raises(AdapterFileError, match="missing"):
        read_adapter(full)


def test_the_revision_follows_the_contents_and_the_scale(
    adapters: Adapters, tmp_path: Path
) -> None:
    base = adapter_revision([adapters.sql], [None])
    assert adapter_revision([adapters.sql], [None]) == base
    assert adapter_revision([adapters.sql], [2.0]) != base
    moved = tmp_path / "moved"
    shutil.copytree(adapters.sql, moved)
    assert adapter_revision([moved], [None]) == base  # a content digest, not a name
    (moved / "adapters.safetensors").write_bytes(
        (adapters.tests / "adapters.safetensors").read_bytes()
    )
    assert adapter_revision([moved], [None]) != base


def test_modelfile_parses_and_renders_back() -> None:
    text = (
        "# a comment\nFROM coder\nADAPTER ./sql\nPARAMETER temperature 0.2\n"
        'PARAMETER stop "<|end|>"\nPARAMETER stop "###"\nSYSTEM """You are\nterse."""\n'
        "MESSAGE user hi\nMESSAGE assistant hello\n"
    )
    spec = parse_modelfile(text)
    assert spec.from_ == "coder" and spec.adapters == [AdapterRef("./sql")]
    assert spec.parameters == {"temperature": 0.2, "stop": ["<|end|>", "###"]}
    assert spec.system == "You are\nterse."
    assert spec.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    again = parse_modelfile(
        render_modelfile(
            "coder", [AdapterRef("./sql")], spec.parameters, spec.system, None, spec.messages
        )
    )
    assert again == spec
    # mlxd's own: an adapter's scale, the draft's adapters, a path with a space
    scaled = [AdapterRef("/a/sql", 5.0), AdapterRef("/a b/tests", 0.0), AdapterRef("/a/x")]
    text = render_modelfile("coder", scaled, {}, None, None, draft="/d", draft_adapters=scaled[:1])
    assert "ADAPTER /a/sql scale=5.0" in text and "DRAFT_ADAPTER /a/sql scale=5.0" in text
    back = parse_modelfile(text)
    assert back.adapters == scaled and back.draft_adapters == scaled[:1] and back.draft == "/d"
    odd = [AdapterRef("/data/lora scale=1"), AdapterRef('/q"uote d/x', 2.0)]
    text = render_modelfile("/m dir/x", odd, {}, None, None, draft="/d dir/y")
    back = parse_modelfile(text)
    assert back.adapters == odd and back.from_ == "/m dir/x" and back.draft == "/d dir/y"
    for bad, message in [
        ("ADAPTER x\n", "no FROM"),
        ("FROM a\nPARAMETER temprature 1\n", "unknown parameter"),
        ("FROM a\nPARAMETER num_ctx many\n", "invalid value"),
        ('FROM a\nSYSTEM """open\n', "unterminated"),
        ("FROM a\nLORA x\n", "unknown command"),
        ("FROM a\nADAPTER /x scale=lots\n", "finite number"),
        ("FROM a\nADAPTER /x scale=inf\n", "finite number"),
        ('FROM a\nADAPTER "/x" y\n', "unexpected"),
    ]:
        with pytest.raises(ModelfileError, match=message):
            parse_modelfile(bad)


def test_tensors_outside_what_the_config_adapts_are_refused_as_mlx_lm_refuses_them(
    adapters: Adapters, tiny_pair: TinyPair, tmp_path: Path
) -> None:
    """`adapter_config.json` names the blocks (`num_layers`, from the last) and projections
    (`lora_parameters.keys`) mlx-lm's loader adapts: a tensor outside them, or of another rank
    than `lora_parameters.rank`, makes mlx-lm refuse the adapter, and mlxd, where it checks the
    files (create, probe-open) and where it mounts them, refuses it too."""
    edited = tmp_path / "edited"
    shutil.copytree(adapters.sql, edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    params = config["lora_parameters"]
    within = sorted({m.split(".", 3)[3] for m in read_adapter(adapters.sql).modules})
    model, _ = mlx_lm.load(str(tiny_pair.target))

    def write(**changes: object) -> None:
        (edited / "adapter_config.json").write_text(json.dumps({**config, **changes}))

    for changes, message in (
        ({"num_layers": 1}, "num_layers"),
        ({"lora_parameters": {**params, "keys": within[:1]}}, "lora_parameters.keys"),
    ):
        write(**changes)
        with pytest.raises(ValueError, match="incompatible tensors"):
            mlx_lm.load(str(tiny_pair.target), adapter_path=str(edited))
        with pytest.raises(AdapterFileError, match=message):
            check_fits(read_adapter(edited), tiny_pair.target)
        with pytest.raises(AdapterError, match=message):
            load_adapters(model, [edited], [None])
    write(lora_parameters={**params, "rank": params["rank"] * 2})
    with pytest.raises(AdapterFileError, match="rank"):
        read_adapter(edited)
    whole = sorted(read_adapter(adapters.sql).modules)  # keys naming whole module paths
    for fine in (
        {"num_layers": -1},
        {"num_layers": 99},
        {"lora_parameters": {**params, "keys": within}},
        {"num_layers": 1, "lora_parameters": {**params, "keys": whole}},
    ):
        write(**fine)
        mlx_lm.load(str(tiny_pair.target), adapter_path=str(edited))  # mlx-lm takes it
        check_fits(read_adapter(edited), tiny_pair.target)
        load_adapters(model, [edited], [None])


def test_a_tensor_outside_the_blocks_is_taken_only_where_a_key_names_it() -> None:
    """mlx-lm adapts a module outside the numbered blocks (`lm_head`) only where a key names
    its whole path: refused under any other keys, or none."""
    modules = {"lm_head": {"lora_a": [4, 8], "lora_b": [8, 4]}}
    blocks = {"model.layers": 2}
    for keys in (None, ("self_attn.q_proj",)):
        info = AdapterInfo(Path("/a"), "lora", 1.0, 8, modules, -1, keys)
        with pytest.raises(AdapterFileError, match="outside the blocks"):
            check_layout(info, blocks)
    check_layout(AdapterInfo(Path("/a"), "lora", 1.0, 8, modules, -1, ("lm_head",)), blocks)


def test_blocks_past_num_hidden_layers_for_token_prediction_do_not_count(
    adapters: Adapters, tiny_pair: TinyPair, tmp_path: Path
) -> None:
    """A checkpoint's multi-token-prediction blocks (`num_nextn_predict_layers`), which mlx-lm
    drops at load, are not among the blocks an adapter's `num_layers` counts back from: an
    adapter of every block fits (it was refused at create, and mounted)."""
    base = tmp_path / "base"
    shutil.copytree(tiny_pair.target, base)
    config = json.loads((base / "config.json").read_text())
    layers = config["num_hidden_layers"]
    (base / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    header = read_safetensors_header(next(base.glob("model*.safetensors")))
    shape = header["model.layers.0.self_attn.q_proj.weight"]["shape"]
    mx.save_safetensors(
        str(base / "model-mtp.safetensors"),
        {f"model.layers.{layers}.self_attn.q_proj.weight": mx.zeros(shape)},
    )
    adapter = tmp_path / "adapter"
    shutil.copytree(adapters.sql, adapter)
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(
        json.dumps({**adapter_config, "num_layers": layers})
    )
    check_fits(read_adapter(adapter), base)
    (base / "config.json").write_text(json.dumps(config))  # no such blocks declared: refused
    with pytest.raises(AdapterFileError, match="num_layers"):
        check_fits(read_adapter(adapter), base)
