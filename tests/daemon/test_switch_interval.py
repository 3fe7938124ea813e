"""`MLXD_SWITCH_INTERVAL_US` sets how long a thread waiting for the GIL lets its holder run."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from mlxd.daemon import server


@pytest.fixture
def interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.usefixtures("interval")
def test_the_interval_is_set_in_microseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(server.SWITCH_ENV, "200")
    server._switch_interval()
    assert sys.getswitchinterval() == pytest.approx(200e-6)


@pytest.mark.usefixtures("interval")
def test_unset_or_unreadable_leaves_python_s_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = sys.getswitchinterval()
    monkeypatch.delenv(server.SWITCH_ENV, raising=False)
    server._switch_interval()
    monkeypatch.setenv(server.SWITCH_ENV, "fast")
    server._switch_interval()
    assert sys.getswitchinterval() == before
    assert "not a number of microseconds" in caplog.text
