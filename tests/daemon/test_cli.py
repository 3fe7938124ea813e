"""The real `mlxd` CLI in subprocesses against a real server, plus its input helpers."""

from __future__ import annotations

import builtins
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.daemon import cli
from mlxd.daemon.client import Client
from tests.conftest import RunningServer, ServerThread, free_port, wait_for
from tests.fixtures.tiny_models import TinyPair

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 90.0  # generous bounds on process start/stop: correctness, not speed


def cli_env(port: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("OLLAMA_HOST", "MLXD_REGISTRY"):
        env.pop(key, None)
    env["MLXD_HOST"] = f"127.0.0.1:{port}"
    env["PYTHONIOENCODING"] = "utf-8"
    env.update(extra)
    return env


def mlxd(
    args: Iterable[str], port: int, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run the CLI; stdin is a pipe with `stdin` written to it, or /dev/null when None."""
    kwargs: dict[str, Any] = (
        {"input": stdin.encode()} if stdin is not None else {"stdin": subprocess.DEVNULL}
    )
    return subprocess.run(
        [sys.executable, "-m", "mlxd.daemon.cli", *args],
        cwd=REPO, env=dict(env) if env is not None else cli_env(port),
        capture_output=True, timeout=180, check=False, **kwargs,
    )  # fmt: skip


def out(result: subprocess.CompletedProcess[bytes]) -> str:
    return result.stdout.decode("utf-8")


def err(result: subprocess.CompletedProcess[bytes]) -> str:
    return result.stderr.decode("utf-8")


def api_generate(server: RunningServer, prompt: str, model: str = "sys") -> dict[str, Any]:
    r = httpx.post(
        f"{server.base_url}/api/generate",
        json={"model": model, "prompt": prompt, "stream": False},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/api/version", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# -- list / show / -v ------------------------------------------------------------------------


def test_list(server: RunningServer) -> None:
    result = mlxd(["list"], server.port)
    assert result.returncode == 0, err(result)
    lines = out(result).splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED", "STATUS"]
    tags = httpx.get(f"{server.base_url}/api/tags").json()["models"]
    rows = {line.split()[0]: line for line in lines[1:]}
    for m in tags:
        assert m["name"] in rows
        assert m["digest"][:12] in rows[m["name"]]
    assert {"tiny:latest", "pair:latest", "selfdraft:latest", "sys:latest"} <= set(rows)
    assert "ago" in rows["tiny:latest"] or "Less than a minute" in rows["tiny:latest"]


def test_list_says_what_no_pull_can_bring_and_a_refused_edit(
    tiny_pair: TinyPair, tmp_path: Path
) -> None:
    """An entry naming a local directory that is not there is unavailable, not "not pulled"
    (a pull cannot make it); an edit of the registry that was refused is said on stderr."""
    path = tmp_path / "models.yaml"
    gone = tmp_path / "gone"
    path.write_text(
        f"models:\n  tiny:\n    target: {tiny_pair.target}\n  ghost:\n    target: {gone}\n",
        encoding="utf-8",
    )
    with ServerThread(path) as srv:
        result = mlxd(["list"], srv.port)
        [row] = [line for line in out(result).splitlines() if line.startswith("ghost")]
        assert f"unavailable: {gone} does not exist" in row and "mlxd pull" not in row, row
        assert "Warning" not in err(result)
        path.write_text(path.read_text(encoding="utf-8") + "oops: [\n", encoding="utf-8")
        tags = f"{srv.base_url}/api/tags"
        assert wait_for(lambda: "warning" in httpx.get(tags, timeout=30).json(), 60)
        result = mlxd(["list"], srv.port)
        assert result.returncode == 0
        assert "Warning: serving the last good registry" in err(result), err(result)


def test_ls_alias(server: RunningServer) -> None:
    result = mlxd(["ls"], server.port)
    assert result.returncode == 0
    assert "tiny:latest" in out(result)


def test_list_a_prefix(server: RunningServer) -> None:
    """As `ollama list PREFIX`: only the names that start with it (case aside)."""
    names = [line.split()[0] for line in out(mlxd(["list", "PA"], server.port)).splitlines()[1:]]
    assert names and all(n.startswith("pa") for n in names)
    assert len(out(mlxd(["list"], server.port)).splitlines()) > len(names) + 1


def test_show(server: RunningServer) -> None:
    result = mlxd(["show", "tiny"], server.port)
    assert result.returncode == 0, err(result)
    text = out(result)
    info = httpx.post(f"{server.base_url}/api/show", json={"model": "tiny"}).json()
    ctx = info["model_info"]["llama.context_length"]
    assert re.search(r"architecture\s+llama", text)
    assert re.search(rf"context length\s+{ctx}\b", text)
    assert "Capabilities" in text
    caps = text.split("Capabilities", 1)[1].split()
    assert "completion" in caps and "insert" in caps


def test_show_prints_the_system_prompt_as_ollama_does(server: RunningServer) -> None:
    result = mlxd(["show", "sys"], server.port)
    assert result.returncode == 0, err(result)
    assert re.search(r"System\n\s+You are terse\.", out(result)), out(result)


def test_show_pair_names_the_draft(server: RunningServer) -> None:
    result = mlxd(["show", "pair"], server.port)
    assert result.returncode == 0
    assert "Draft" in out(result)


def test_show_modelfile(server: RunningServer) -> None:
    result = mlxd(["show", "--modelfile", "sys"], server.port)
    assert result.returncode == 0, err(result)
    text = out(result)
    assert text.startswith("# Modelfile generated by")
    assert re.search(r"^FROM \S+", text, re.M)
    assert 'SYSTEM """You are terse."""' in text
    assert re.search(r"^PARAMETER num_predict\s+8$", text, re.M)


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--parameters", "num_predict"),
        ("--system", "You are terse."),
        ("--template", "<|im_start|>"),
    ],
)
def test_show_flags(server: RunningServer, flag: str, expected: str) -> None:
    result = mlxd(["show", flag, "sys"], server.port)
    assert result.returncode == 0, err(result)
    assert expected in out(result)


def test_show_license(tiny_pair: TinyPair, tmp_path: Path) -> None:
    """`show --license` prints the model directory's license file; nothing without one."""
    model = tmp_path / "licensed"
    shutil.copytree(tiny_pair.target, model)
    (model / "LICENSE").write_text("Apache License 2.0\n", encoding="utf-8")
    path = tmp_path / "models.yaml"
    path.write_text(
        f"models:\n  licensed:\n    target: {model}\n  tiny:\n    target: {tiny_pair.target}\n",
        encoding="utf-8",
    )
    with ServerThread(path) as srv:
        result = mlxd(["show", "licensed", "--license"], srv.port)
        assert result.returncode == 0 and out(result) == "Apache License 2.0\n", err(result)
        result = mlxd(["show", "--license", "tiny"], srv.port)
        assert result.returncode == 0 and out(result) == "\n"


def test_show_unknown_model(server: RunningServer) -> None:
    result = mlxd(["show", "nope"], server.port)
    assert result.returncode != 0
    assert "not found" in err(result)
    assert "Traceback" not in err(result)


def test_version_flag(server: RunningServer) -> None:
    result = mlxd(["-v"], server.port)
    assert result.returncode == 0
    version = httpx.get(f"{server.base_url}/api/version").json()["version"]
    assert "mlxd version is" in out(result)
    assert version in out(result)


# -- run -------------------------------------------------------------------------------------


def test_run_one_shot(server: RunningServer) -> None:
    result = mlxd(["run", "sys", "def f():"], server.port)
    assert result.returncode == 0, err(result)
    expected = api_generate(server, "def f():")
    assert expected["eval_count"] == 8
    assert out(result) == expected["response"] + "\n"


def test_run_prompt_words_are_joined(server: RunningServer) -> None:
    result = mlxd(["run", "sys", "tell", "me", "a", "story"], server.port)
    assert result.returncode == 0, err(result)
    assert out(result) == api_generate(server, "tell me a story")["response"] + "\n"


def test_run_piped_stdin(server: RunningServer) -> None:
    result = mlxd(["run", "sys"], server.port, stdin="hello")
    assert result.returncode == 0, err(result)
    assert out(result) == api_generate(server, "hello")["response"] + "\n"


def test_run_piped_stdin_is_prepended_to_the_prompt(server: RunningServer) -> None:
    result = mlxd(["run", "sys", "Summarize this."], server.port, stdin="Some text")
    assert result.returncode == 0, err(result)
    assert out(result) == api_generate(server, "Some text\nSummarize this.")["response"] + "\n"


def test_run_verbose_prints_stats(server: RunningServer) -> None:
    result = mlxd(["run", "--verbose", "sys", "hi"], server.port)
    assert result.returncode == 0, err(result)
    stats = err(result)
    for key in (
        "total duration:",
        "load duration:",
        "prompt eval count:",
        "eval count:",
        "eval rate:",
    ):
        assert key in stats, stats
    assert re.search(r"^eval count:\s+8 token\(s\)$", stats, re.M)
    assert out(result) == api_generate(server, "hi")["response"] + "\n"


@pytest.fixture(scope="module")
def spec_server(
    tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """A server whose self-drafting entry has a short num_predict (the CLI has no option flags)."""
    registry = tmp_path_factory.mktemp("spec") / "models.yaml"
    registry.write_text(
        "models:\n"
        f"  spec:\n    target: {tiny_pair.target}\n    draft: {tiny_pair.target}\n"
        "    options:\n      temperature: 0\n      num_predict: 12\n      draft_method: model\n",
        encoding="utf-8",
    )
    with ServerThread(registry) as info:
        yield info


def test_run_verbose_reports_drafting(spec_server: RunningServer) -> None:
    result = mlxd(["run", "--verbose", "spec", "hi"], spec_server.port)
    assert result.returncode == 0, err(result)
    stats = err(result)
    assert re.search(r"^draft method:\s+model$", stats, re.M), stats
    rate = re.search(r"^draft acceptance:\s+([\d.]+)%$", stats, re.M)
    assert rate is not None and float(rate.group(1)) > 90.0  # the target drafting for itself
    assert re.search(r"^eval count:\s+12 token\(s\)$", stats, re.M)
    assert out(result) == api_generate(spec_server, "hi", model="spec")["response"] + "\n"


def test_run_unknown_model(server: RunningServer) -> None:
    result = mlxd(["run", "nope", "hello"], server.port)
    assert result.returncode != 0
    assert "model 'nope:latest' not found" in err(result)
    assert "Traceback" not in err(result)
    assert out(result) == ""


def test_run_invalid_model_name(server: RunningServer) -> None:
    result = mlxd(["run", "bad name!", "hello"], server.port)
    assert result.returncode != 0
    assert "invalid model name" in err(result)


def test_run_into_a_reader_that_leaves_ends_quietly(server: RunningServer) -> None:
    """`mlxd run ... | head -1`: the pipe's reader goes, the CLI ends without a traceback."""
    command = [sys.executable, "-m", "mlxd.daemon.cli", "run", "tiny", "write a long story"]
    with subprocess.Popen(
        command, cwd=REPO, env=cli_env(server.port), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.read(1)
        proc.stdout.close()  # as `head` does once it has its line
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=180)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert code in (0, 141)


def _dies_mid_stream(sock: socket.socket) -> None:
    """An HTTP server that answers heartbeats, then a stream's first line, then goes away (a
    daemon killed while it streams)."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            head = conn.recv(65536)
            if head.startswith(b"HEAD"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                continue
            line = b'{"status":"pulling manifest"}\n'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(line), line)
            )


def test_a_daemon_that_dies_mid_stream_is_an_error_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        threading.Thread(target=_dies_mid_stream, args=(sock,), daemon=True).start()
        result = mlxd(["pull", "some/model"], sock.getsockname()[1])
    assert result.returncode == 1, err(result)
    assert "lost the connection to the mlxd daemon" in err(result)
    assert "Traceback" not in err(result)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MLXD_HOST": "127.0.0.1:99999"}, "invalid host"),
        ({"MLXD_HOST": "http://[::1"}, "invalid host"),
    ],
)
def test_a_bad_host_is_an_error_line(env: dict[str, str], message: str) -> None:
    for args in (["list"], ["-v"]):
        result = mlxd(args, 0, env=cli_env(0, **env))
        assert result.returncode == 1 and message in err(result), err(result)
        assert "Traceback" not in err(result)


def test_a_home_that_cannot_be_made_is_an_error_line(tmp_path: Path) -> None:
    """No daemon answers, so the CLI would start one under MLXD_HOME: a file there is a
    plain error, not a traceback."""
    home = tmp_path / "afile"
    home.write_text("", encoding="utf-8")
    result = mlxd(["list"], free_port(), env=cli_env(free_port(), MLXD_HOME=str(home)))
    assert result.returncode == 1 and err(result).startswith("Error: "), err(result)
    assert "Traceback" not in err(result)


def test_a_modelfile_that_is_not_text_is_an_error_line(
    server: RunningServer, tmp_path: Path
) -> None:
    modelfile = tmp_path / "Modelfile"
    modelfile.write_bytes(b"FROM tiny\n\xff\xfe\x80 not utf-8\n")
    result = mlxd(["create", "bad", "-f", str(modelfile)], server.port)
    assert result.returncode == 1 and "UTF-8" in err(result), err(result)
    assert "Traceback" not in err(result)


# -- serve -----------------------------------------------------------------------------------


def test_serve_port_in_use(server: RunningServer) -> None:
    result = mlxd(["serve", "--registry", str(server.registry)], server.port)
    assert result.returncode == 1
    assert "address already in use" in err(result)
    assert "Traceback" not in err(result)
    assert answers(server.base_url)  # the running server is untouched


def test_a_daemon_holds_its_port_from_the_start() -> None:
    """Two daemons started at once (two CLIs starting one each): the port is held from the
    check on, so the second is refused with the error line, not after its startup inside
    uvicorn (status 3); a daemon started right after one stopped binds the port again."""
    from mlxd.daemon.server import bind

    port = free_port()
    first = bind("127.0.0.1", port)
    assert not isinstance(first, str)
    try:
        assert bind("127.0.0.1", port) == "address already in use"
    finally:
        first.close()
    again = bind("127.0.0.1", port)
    assert not isinstance(again, str)
    again.close()


@dataclass
class Served:
    answered: dict[str, Any]
    returncode: int
    log: str


@pytest.fixture(scope="module")
def served_then_terminated(
    server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> Served:
    """`mlxd serve` on a free port: wait until it answers, then SIGTERM it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(server.registry)],
            cwd=REPO, env=cli_env(port), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not answers(base):
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "mlxd serve did not come up"
                time.sleep(0.1)
            answered = httpx.get(f"{base}/api/version").json()
            r = httpx.post(
                f"{base}/api/generate",
                json={"model": "sys", "prompt": "hi", "stream": False},
                timeout=120,
            )
            answered["generate"] = r.json()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return Served(answered, proc.returncode, log_path.read_text())


def test_serve_answers_and_stops_on_sigterm(served_then_terminated: Served) -> None:
    s = served_then_terminated
    assert "version" in s.answered
    assert s.answered["generate"]["done"] is True
    assert s.answered["generate"]["eval_count"] == 8
    # a graceful shutdown: the app's lifespan ran to completion
    assert "Application shutdown complete" in s.log, s.log
    assert "Traceback" not in s.log


def test_serve_sigterm_exit_status_is_zero(served_then_terminated: Served) -> None:
    assert served_then_terminated.returncode == 0, served_then_terminated.log[-3000:]


# -- run starts a daemon when none is listening ------------------------------------------------


def _pid_from_log(log: Path) -> int | None:
    if not log.is_file():
        return None
    found = re.findall(r"Started server process \[(\d+)\]", log.read_text(errors="replace"))
    return int(found[-1]) if found else None


def _pids_with_env(entry: str) -> list[int]:
    """Linux only: processes whose environment holds `entry` (our unique marker)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    needle = entry.encode()
    pids = []
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def autostart(server: RunningServer, tmp_path: Path) -> Iterator[tuple[dict[str, str], str, Path]]:
    """An environment pointing at a free port with the test registry; kills what it spawned."""
    port = free_port()
    marker = f"MLXD_TEST_MARKER={uuid.uuid4().hex}"
    home = tmp_path / "home"
    env = cli_env(
        port,
        MLXD_REGISTRY=str(server.registry),
        MLXD_HOME=str(home),
        MLXD_TEST_MARKER=marker.split("=", 1)[1],
    )
    log = home / "logs" / "server.log"
    try:
        yield env, f"http://127.0.0.1:{port}", log
    finally:
        if Path("/proc").is_dir():
            pids = set(_pids_with_env(marker))  # everything our environment reached
        else:
            logged = _pid_from_log(log)  # the daemon logs its pid to our private home
            pids = {logged} if logged is not None else set()
        for pid in pids:
            _terminate(pid)
        assert not answers(f"http://127.0.0.1:{port}"), "the spawned daemon is still running"


def test_run_starts_the_daemon(autostart: tuple[dict[str, str], str, Path]) -> None:
    env, base, log = autostart
    assert not answers(base)
    result = mlxd(["run", "sys", "hi"], 0, env=env)
    assert result.returncode == 0, err(result) + (log.read_text() if log.is_file() else "")
    assert len(out(result)) > 1
    # the daemon stays up in the background, logging to $MLXD_HOME/logs/server.log
    assert answers(base)
    assert _pid_from_log(log) is not None
    again = mlxd(["run", "sys", "hi"], 0, env=env)
    assert again.returncode == 0
    assert out(again) == out(result)


# -- interactive helpers (in process) ----------------------------------------------------------


CTRL_C = "\x03"  # a line fed as this is Ctrl-C at that prompt


def feed_input(monkeypatch: pytest.MonkeyPatch, lines: list[str]) -> list[str]:
    """Replace input(): returns the lines in order, then EOF; records the prompts shown."""
    prompts: list[str] = []
    it = iter(lines)

    def fake(prompt: str = "") -> str:
        prompts.append(prompt)
        try:
            line = next(it)
        except StopIteration:
            raise EOFError from None
        if line == CTRL_C:
            raise KeyboardInterrupt
        return line

    monkeypatch.setattr(builtins, "input", fake)
    return prompts


def test_read_multiline(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = feed_input(monkeypatch, ["second line", "third line", 'last"""'])
    assert cli._read_multiline('"""first line') == "first line\nsecond line\nthird line\nlast"
    assert prompts == ["... "] * 3


def test_read_multiline_opening_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    feed_input(monkeypatch, ["a", "", "b", '"""'])
    assert cli._read_multiline('"""') == "a\n\nb"


def test_read_multiline_eof(monkeypatch: pytest.MonkeyPatch) -> None:
    feed_input(monkeypatch, ["a"])
    with pytest.raises(EOFError):
        cli._read_multiline('"""x')


def chat(server: RunningServer, monkeypatch: pytest.MonkeyPatch, lines: list[str]) -> None:
    """`mlxd run sys`'s chat over `lines` typed in turn (then EOF); it ends with status 0."""
    feed_input(monkeypatch, lines)
    args = cli.parse_args(cli.build_parser(), ["run", "sys"])
    client = Client(server.base_url)
    try:
        assert cli.interactive(client, args, {}) == 0
    finally:
        client.close()


def _chat(server: RunningServer, messages: list[dict[str, str]]) -> str:
    r = httpx.post(
        f"{server.base_url}/api/chat",
        json={"model": "sys", "messages": messages, "stream": False},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["message"]["content"])


def test_interactive_session(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    chat(server, monkeypatch, ['"""line one', 'line two"""', "/set verbose", "again", "/bogus",
                               "/bye", "never"])  # fmt: skip
    captured = capsys.readouterr()
    first = _chat(server, [{"role": "user", "content": "line one\nline two"}])
    second = _chat(
        server,
        [
            {"role": "user", "content": "line one\nline two"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "again"},
        ],
    )
    assert first + "\n\n" in captured.out
    assert second + "\n\n" in captured.out
    assert "Set 'verbose' mode." in captured.out
    assert "Unknown command '/bogus'" in captured.out
    assert "eval rate:" in captured.err  # verbose was switched on before the second turn


def test_ctrl_c_while_typing_drops_the_message_and_the_chat_goes_on(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    chat(server, monkeypatch, ['"""half a', "thought", CTRL_C, "again", "/bye"])
    alone = _chat(server, [{"role": "user", "content": "again"}])  # nothing of the dropped one
    assert alone + "\n\n" in capsys.readouterr().out


def test_an_answer_cut_short_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during an answer (the stream ends with no final object): the next turn's
    history has the question, not the half answer, as Ollama's chat keeps it."""
    sent: list[list[dict[str, Any]]] = []

    def stream(client: Any, path: str, body: dict[str, Any], key: str, *_: Any) -> Any:
        sent.append(list(body["messages"]))
        return ("half an ans", {}) if len(sent) == 1 else ("whole", {"done": True})

    monkeypatch.setattr(cli, "_stream_text", stream)
    feed_input(monkeypatch, ["first", "second", "third"])
    args = cli.parse_args(cli.build_parser(), ["run", "sys"])
    assert cli.interactive(Client("http://127.0.0.1:9"), args, {}) == 0
    assert [m["content"] for m in sent[1]] == ["first", "second"]
    assert [m["content"] for m in sent[2]] == ["first", "second", "whole", "third"]


def test_a_quoted_block_is_a_message_even_opening_with_a_slash(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Text between \"\"\" marks is sent whatever it starts with (a pasted path or traceback),
    as Ollama's chat reads a block before any command: `/bye` there ended the chat."""
    chat(server, monkeypatch, ['"""', "/bye is how a chat ends", '"""', '"""/usr/lib/x.py"""'])
    out = capsys.readouterr().out
    first = _chat(server, [{"role": "user", "content": "/bye is how a chat ends"}])
    assert first + "\n\n" in out
    second = _chat(server, [
        {"role": "user", "content": "/bye is how a chat ends"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "/usr/lib/x.py"},
    ])  # fmt: skip
    assert second + "\n\n" in out
    assert "Unknown command" not in out


def test_a_system_message_of_several_lines(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    chat(server, monkeypatch, ['/set system """You are terse.', 'Answer in one word."""', "hi"])
    out = capsys.readouterr().out
    system = {"role": "system", "content": "You are terse.\nAnswer in one word."}
    assert _chat(server, [system, {"role": "user", "content": "hi"}]) + "\n\n" in out
    assert out.count("Set system message.") == 1


def test_set_format_and_think_reach_the_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    bodies: list[dict[str, Any]] = []

    def stream(client: Any, path: str, body: dict[str, Any], key: str, *_: Any) -> Any:
        bodies.append(body)
        return "ok", {"done": True}

    monkeypatch.setattr(cli, "_stream_text", stream)
    feed_input(monkeypatch, ["/set format json", "/set nothink", "a", "/set noformat",
                             "/set think", "b", "/set nowordwrap", "/set", "c"])  # fmt: skip
    args = cli.parse_args(cli.build_parser(), ["run", "sys", "--format", "json"])
    assert cli.interactive(Client("http://127.0.0.1:9"), args, {}) == 0
    assert (bodies[0]["format"], bodies[0]["think"]) == ("json", False)
    assert "format" not in bodies[1] and bodies[1]["think"] is True
    assert "format" not in bodies[2]


def test_hidethinking_shows_none_of_it() -> None:
    args = cli.parse_args(cli.build_parser(), ["run", "m", "--think=false", "--hidethinking"])
    assert args.hidethinking and args.think == "false"
    out = io.StringIO()
    printer = cli.ThinkingPrinter(out, hidden=True)
    printer.write("pondering")
    printer.end()
    assert out.getvalue() == ""


def test_interactive_eof_exits(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    chat(server, monkeypatch, [])
