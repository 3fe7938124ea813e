"""A short soak through the real server: mixed routes, streams, draft methods and
temperatures, 8 at a time, some streams dropped by the client (bench/soak.py is the long one)."""

from __future__ import annotations

from pathlib import Path

from bench.soak import REGISTRY, run_soak
from tests.conftest import ServerThread


def test_soak(tmp_path: Path) -> None:
    registry = tmp_path / "models.yaml"
    registry.write_text(REGISTRY, encoding="utf-8")
    with ServerThread(registry, cache_dir=tmp_path / "kv") as info:
        report = run_soak(info.base_url, 60, 8, tokens=16, hang=120.0, seed=1)
    summary = "\n".join(report.lines())
    assert len(report.outcomes) == 60
    assert report.disconnects > 0, summary
    assert report.five_xx == 0, summary
    assert report.hangs == 0, summary
    assert not report.transport_errors, summary
    assert not report.stream_errors, summary
    assert set(report.statuses) == {"200"}, summary
    assert len(report.greedy_checked()) >= 10, summary
    assert not report.greedy_mismatches(), summary
    assert (report.leftover_rows, report.leftover_queue) == (0, 0), summary
    assert report.counted == report.sent, summary
