"""The chat's `/show modelfile`: the session's settings take the place of the model's own."""

from __future__ import annotations

import pytest

from mlxd.daemon import repl

MODELFILE = (
    "FROM /models/x\n"
    'SYSTEM """old\nsecond line"""\n'
    "PARAMETER num_predict 128\n"
    'PARAMETER stop "<x>"\n'
    "PARAMETER temperature 0.5\n"
)


@pytest.mark.parametrize("system", [None, "new"])
def test_session_settings_replace_the_models(system: str | None) -> None:
    session = repl.Session("m", {"num_predict": 8, "stop": ["a", "b"]}, verbose=False)
    session.system = system
    lines = repl.modelfile_text(session, MODELFILE).splitlines()
    assert [line for line in lines if line.startswith("PARAMETER num_predict")] == [
        "PARAMETER num_predict 8"
    ]
    assert [line for line in lines if line.startswith("PARAMETER stop")] == [
        'PARAMETER stop "a"',
        'PARAMETER stop "b"',
    ]
    assert "PARAMETER temperature 0.5" in lines
    if system:
        assert 'SYSTEM """new"""' in lines and "second line" not in "\n".join(lines)
    else:
        assert 'SYSTEM """old' in lines and 'second line"""' in lines
