"""`distributed:` in models.yaml: what is accepted and how mistakes are reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.registry.distributed import Distribution
from mlxd.registry.schema import ModelEntry, RegistryError, load_registry_file


def load(tmp_path: Path, body: str) -> ModelEntry:
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  big:\n    target: /m/t\n{body}", encoding="utf-8")
    (entry,) = load_registry_file(path).values()
    return entry


def test_hosts_backend_and_strategy(tmp_path: Path) -> None:
    entry = load(
        tmp_path,
        "    distributed:\n      hosts: [10.0.0.1, 10.0.0.2]\n"
        "      backend: nccl\n      strategy: pipeline\n",
    )
    assert entry.distributed is not None
    assert entry.distributed == Distribution(
        hosts=("10.0.0.1", "10.0.0.2"), backend="nccl", strategy="pipeline"
    )
    assert entry.distributed.namespace == "pipelinex2"


def test_hostfile_is_resolved_beside_the_registry(tmp_path: Path) -> None:
    entry = load(tmp_path, "    distributed: {hostfile: hosts.json}\n")
    dist = entry.distributed
    assert dist is not None
    assert dist.hostfile == str(tmp_path / "hosts.json")
    assert (dist.backend, dist.strategy) == ("ring", "tensor")


def test_the_split_is_part_of_the_load_key(tmp_path: Path) -> None:
    plain = load(tmp_path, "")
    sharded = load(tmp_path, "    distributed: {hosts: [127.0.0.1, 127.0.0.1]}\n")
    assert plain.load_key != sharded.load_key


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[a, b]", "expected a mapping"),
        ("{hosts: [127.0.0.1]}", "at least two ranks"),
        ("{hosts: [a, b], hostfile: h.json}", "exactly one of 'hosts'"),
        ("{}", "exactly one of 'hosts'"),
        ("{hosts: [a, b], backend: mpi}", "'backend': expected one of ring, jaccl, nccl, auto"),
        ("{hosts: [a, b], strategy: data}", "'strategy': expected one of tensor, pipeline"),
        ("{hosts: [a, b], port: 70000}", "'port': expected a TCP port"),
        ("{hosts: [a, b], timeout: 0}", "'timeout': expected a positive number"),
        ("{hosts: [a, b], ranks: 2}", "unknown key 'ranks'"),
        ("{hosts: 'a,b'}", "'hosts': expected a list"),
    ],
)
def test_mistakes_say_where_and_why(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(RegistryError) as err:
        load(tmp_path, f"    distributed: {body}\n")
    text = str(err.value)
    assert "entry 'big'" in text and "key 'distributed'" in text and message in text
    assert "models.yaml:" in text


def test_adapters_are_refused(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="cannot mount adapters"):
        load(tmp_path, "    adapters: [/a]\n    distributed: {hosts: [a, b]}\n")
