"""`mlxd`: serve, run, list, show. Every command but `serve` talks to the daemon over HTTP."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import httpx

from mlxd.daemon import autostart, repl
from mlxd.daemon.client import Client, ClientError
from mlxd.daemon.config import ConfigError, Settings, client_base_url
from mlxd.daemon.pullhelp import explain
from mlxd.registry.adapterfiles import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mlxd.registry.modelfile import ModelfileError, parse_modelfile
from mlxd.registry.names import InvalidModelName, hub_name, parse_name

VERSION = "0.1.0"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


def _client() -> Client:
    return Client(client_base_url())


def _fail(message: str) -> int:
    print(f"Error: {message}", file=sys.stderr)
    return 1


def ensure_daemon(client: Client, wait: float = 60.0) -> None:
    """Start `mlxd serve` in the background when nothing answers, saying so on stderr, and wait
    for it; if it exits instead, fail at once with the end of its log."""
    if client.heartbeat():
        return
    started = autostart.start()
    print(
        f"Starting the mlxd daemon for {client.base_url} (log: {started.log})",
        file=sys.stderr,
        flush=True,
    )
    try:
        autostart.wait_until_up(started, client.heartbeat, wait)
    except autostart.DaemonStartError as exc:
        raise ClientError(str(exc)) from exc


# -- formatting ------------------------------------------------------------------------------


def human_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _seconds_until(stamp: str) -> float | None:
    """Seconds from now to an ISO-8601 time (negative when past); None if it does not parse."""
    try:
        then = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (then - datetime.now(timezone.utc)).total_seconds()


def human_ago(stamp: str) -> str:
    until = _seconds_until(stamp)
    if until is None:
        return stamp
    seconds = -until
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "Less than a minute ago"


def human_duration(seconds: float) -> str:
    """Ollama's `format.HumanDuration`."""
    if seconds < 1:
        return "Less than a second"
    if seconds < 60:
        return "1 second" if int(seconds) == 1 else f"{int(seconds)} seconds"
    minutes = int(seconds // 60)
    if minutes < 60:
        return "About a minute" if minutes == 1 else f"{minutes} minutes"
    hours = round(seconds / 3600)
    for limit, unit, size in ((48, "hours", 1), (24 * 14, "days", 24), (24 * 60, "weeks", 168)):
        if hours < limit:
            return "About an hour" if hours == 1 else f"{hours // size} {unit}"
    if hours < 24 * 365 * 2:
        return f"{hours // 720} months"
    return f"{hours // 8760} years"


def human_until(stamp: str) -> str:
    """`ollama ps` UNTIL: "4 minutes from now", "Forever" (over 20 years out), "Stopping..."."""
    seconds = _seconds_until(stamp)
    if seconds is None:
        return stamp
    if seconds < 0:
        return "Stopping..."
    if seconds > 20 * 365 * 86400:
        return "Forever"
    return f"{human_duration(seconds)} from now"


def processor_label(model: dict[str, Any], device: str | None) -> str:
    """PROCESSOR: from the daemon's MLX device, else from size_vram as Ollama's CLI reads it."""
    if device in ("cpu", "gpu"):
        return f"100% {device.upper()}"
    size, vram = int(model.get("size", 0)), int(model.get("size_vram", 0))
    if vram == 0:
        return "100% CPU"
    if vram >= size:
        return "100% GPU"
    cpu = round(100 * (size - vram) / size)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "    ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows
    )


def print_stats(final: dict[str, Any]) -> None:
    def secs(ns: int) -> str:
        return f"{ns / 1e9:.6f}s" if ns < 1e9 else f"{ns / 1e9:.3f}s"

    def rate(count: int, ns: int) -> str:
        return f"{count / (ns / 1e9):.2f} tokens/s" if ns else "n/a"

    lines = [
        ("total duration", secs(final.get("total_duration", 0))),
        ("load duration", secs(final.get("load_duration", 0))),
        ("prompt eval count", f"{final.get('prompt_eval_count', 0)} token(s)"),
        ("prompt eval duration", secs(final.get("prompt_eval_duration", 0))),
        (
            "prompt eval rate",
            rate(final.get("prompt_eval_count", 0), final.get("prompt_eval_duration", 0)),
        ),
        ("eval count", f"{final.get('eval_count', 0)} token(s)"),
        ("eval duration", secs(final.get("eval_duration", 0))),
        ("eval rate", rate(final.get("eval_count", 0), final.get("eval_duration", 0))),
    ]
    if final.get("draft_method", "off") != "off":
        lines.append(("draft method", str(final["draft_method"])))
        lines.append(("draft acceptance", f"{final.get('draft_acceptance_rate', 0):.2%}"))
        lines.append(("tokens per round", f"{final.get('draft_tokens_per_round', 0):.2f}"))
    for key, value in lines:
        print(f"{key + ':':<22}{value}", file=sys.stderr)


# -- commands --------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = Settings.from_env(registry=args.registry)
    except ConfigError as exc:
        return _fail(str(exc))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from mlxd.engine.backend import configure_backend

    backend = configure_backend()  # before anything imports MLX: the CPU BLAS goes under it
    from mlxd.daemon.server import serve

    return serve(settings, backend)


def cmd_list(args: argparse.Namespace) -> int:
    """Pulled models as `ollama list` shows them, then the registered ones not pulled yet."""
    client = _client()
    ensure_daemon(client)
    tags = client.get("/api/tags")
    if tags.get("warning"):  # an edit of a registry file was refused
        print(f"Warning: {tags['warning']}", file=sys.stderr)
    models = tags["models"]
    statuses = _registry_statuses(client)
    rows = [["NAME", "ID", "SIZE", "MODIFIED", "STATUS"]]
    listed = set()
    prefix = (args.prefix or "").lower()  # `ollama list PREFIX`: names that start with it
    models = [m for m in models if m["name"].lower().startswith(prefix)]
    statuses = {n: e for n, e in statuses.items() if n.lower().startswith(prefix)}
    for m in models:
        listed.add(m["name"])
        status = f"unavailable: {m['unavailable']}" if m.get("unavailable") else "ok"
        status = statuses.get(m["name"], {}).get("status", status) if status == "ok" else status
        size, ago = human_size(m["size"]), human_ago(m["modified_at"])
        rows.append([m["name"], m["digest"][:12], size, ago, status])
    if not args.pulled:
        for name, entry in statuses.items():
            if name not in listed and not entry.get("pulled"):
                status = entry.get("status") or "not pulled"
                if status == "not pulled":
                    status = f"not pulled (mlxd pull {_short(name)})"
                rows.append([name, "-", "-", "-", status])
    print(table(rows))
    return 0


def _short(name: str) -> str:
    return name.removesuffix(":latest")


def _registry_statuses(client: Client) -> dict[str, dict[str, Any]]:
    """Every registered pairing by name (mlxd's /api/mlxd/registry); {} from an older daemon."""
    try:
        return {m["name"]: m for m in client.get("/api/mlxd/registry")["models"]}
    except (ClientError, ValueError, KeyError, TypeError):
        return {}


def _require_daemon(client: Client) -> None:
    if not client.heartbeat():
        raise ClientError("could not connect to mlxd server, run 'mlxd serve' to start it")


def _device(client: Client) -> str | None:
    try:
        device = client.get("/api/mlxd/stats").get("device")
    except (ClientError, ValueError, AttributeError):
        return None
    return device if isinstance(device, str) else None


def cmd_ps(args: argparse.Namespace) -> int:
    client = _client()
    _require_daemon(client)
    models = client.get("/api/ps")["models"]
    device = _device(client) if models else None
    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]]
    for m in models:
        rows.append([
            m["name"], m.get("digest", "")[:12], human_size(int(m.get("size", 0))),
            processor_label(m, device), str(m.get("context_length", "")),
            human_until(m.get("expires_at", "")),
        ])  # fmt: skip
    print(table(rows))
    for m in models:  # a distributed pairing's ranks, where they run (and why it stopped)
        for rank in m.get("ranks") or []:
            print(f"  {m['name']}  {rank}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """As `ollama stop`: /api/show, then an empty generate with keep_alive 0; a model that is
    not loaded is said to be so."""
    client = _client()
    _require_daemon(client)
    try:
        client.post("/api/show", {"model": args.model})
    except ClientError as exc:
        if "not found" in str(exc):
            return _fail(f'couldn\'t find model "{args.model}" to stop')
        raise
    if not _loaded(client, args.model):
        print(f'model "{args.model}" is not loaded', file=sys.stderr)
        return 0
    client.post("/api/generate", {"model": args.model, "keep_alive": 0, "stream": False})
    return 0


def _loaded(client: Client, model: str) -> bool:
    """Whether /api/ps lists `model` (by its name or the hub name a pull of it registered),
    as a model or as an entry a shared base serves."""
    try:
        names = {n.lower() for n in (parse_name(model).display, _hub_name(model)) if n}
    except InvalidModelName:
        names = {model.lower()}
    return any(
        {n.lower() for n in [m.get("name", ""), *(m.get("serves") or [])]} & names
        for m in client.get("/api/ps")["models"]
    )


SHOW_FIELDS = ("license", "modelfile", "parameters", "system", "template")  # `show --FIELD`


def cmd_show(args: argparse.Namespace) -> int:
    client = _client()
    ensure_daemon(client)
    info = client.post("/api/show", {"model": args.model})
    for field in SHOW_FIELDS:
        if getattr(args, field):
            print(info.get(field) or "")
            return 0
    show_info(info)
    return 0


def show_info(info: dict[str, Any]) -> None:
    """`mlxd show`'s summary (and the chat's `/show info`)."""
    d = info.get("details", {})
    mi = info.get("model_info", {})
    arch = mi.get("general.architecture", d.get("family", ""))
    print("  Model")
    for key, value in (
        ("architecture", arch),
        ("parameters", d.get("parameter_size", "")),
        ("context length", mi.get(f"{arch}.context_length", "")),
        ("embedding length", mi.get(f"{arch}.embedding_length", "")),
        ("quantization", d.get("quantization_level", "")),
    ):
        print(f"    {key:<20}{value}")
    if info.get("draft"):
        print("\n  Draft")
        print(f"    {'model':<20}{info['draft']['model']}")
    print("\n  Capabilities")
    for cap in info.get("capabilities", []):
        print(f"    {cap}")
    if info.get("parameters"):
        print("\n  Parameters")
        for line in info["parameters"].splitlines():
            print(f"    {line}")
    for title, key in (("System", "system"), ("License", "license")):
        lines = [line for line in (info.get(key) or "").splitlines() if line.strip()]
        if lines:  # as Ollama shows them: the first two lines
            print(f"\n  {title}")
            for line in lines[:2]:
                print(f"    {line.strip()}")
            if len(lines) > 2:
                print("    ...")


def _stream_text(
    client: Client, path: str, body: dict[str, Any], key: str, hide_thinking: bool = False
) -> tuple[str, dict[str, Any]]:
    text: list[str] = []
    final: dict[str, Any] = {}
    thoughts = ThinkingPrinter(sys.stdout, hidden=hide_thinking)
    try:
        for obj in client.stream(path, body):
            fields = obj if key == "response" else obj.get("message", {})
            thoughts.write(fields.get("thinking") or "")
            piece = fields.get("response" if key == "response" else "content") or ""
            if piece:
                thoughts.end()
                text.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            if obj.get("done"):
                final = obj
    except KeyboardInterrupt:
        pass
    thoughts.end()
    return "".join(text), final


class ThinkingPrinter:
    """A reply's thinking before its answer, as Ollama's CLI shows it: dimmed on a terminal,
    between `Thinking...` and `...done thinking.` lines otherwise."""

    def __init__(self, out: TextIO, hidden: bool = False) -> None:
        self.out = out
        self.tty = out.isatty()
        self.hidden = hidden  # `--hidethinking`: the model thinks, nothing of it is shown
        self.open = False

    def write(self, text: str) -> None:
        if not text or self.hidden:
            return
        if not self.open:
            self.out.write("\x1b[2m" if self.tty else "Thinking...\n")
            self.open = True
        self.out.write(text)
        self.out.flush()

    def end(self) -> None:
        if self.open:
            self.out.write("\x1b[0m\n\n" if self.tty else "\n...done thinking.\n\n")
            self.open = False


def _read_multiline(first: str) -> str:
    """The text between `first`, a line opening with \"\"\", and the line that ends with them."""
    lines = [first[3:]]
    while True:
        line = input("... ")
        if line.endswith('"""'):
            lines.append(line[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def _quoted_block(text: str) -> str | None:
    """The message of a line opening with \"\"\": a one-line block's text, or the lines up to
    the closing quotes (KeyboardInterrupt drops them); None for a line that opens none."""
    if not text.startswith('"""'):
        return None
    if text.endswith('"""') and len(text) > 5:
        return text[3:-3]
    return _read_multiline(text)


def _line_editing() -> None:
    """Arrow keys, history and pasting as a terminal's line editor gives them (`input` takes
    them from `readline` once it is loaded): a paste of several lines arrives as one message
    where the terminal brackets it."""
    try:
        import readline
    except ImportError:  # a Python built without it: plain input
        return
    if "libedit" not in (readline.__doc__ or ""):  # GNU readline's setting (macOS: libedit)
        readline.parse_and_bind("set enable-bracketed-paste on")


def interactive(client: Client, args: argparse.Namespace, options: dict[str, Any]) -> int:
    fields = run_fields(args)
    session = repl.Session(
        args.model, options, verbose=args.verbose,
        format=fields.pop("format", None), think=fields.pop("think", None),
    )  # fmt: skip
    if sys.stdin.isatty():
        _line_editing()
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\nUse Ctrl + d or /bye to exit.")
            continue
        try:
            block = _quoted_block(line)
            system = repl.system_block(line)
            if system is not None:  # `/set system \"\"\"...`: the system message's lines
                repl.set_system(session, _quoted_block(system) or "")
                continue
        except EOFError:
            return 0
        except KeyboardInterrupt:  # drops what was typed; the chat goes on
            print()
            continue
        if block is None and line.strip().startswith("/"):  # a quoted block is a message
            if not repl.command(client, session, line.strip(), show_info):
                return 0
            continue
        line = line if block is None else block
        if not line.strip():
            continue
        session.history.append({"role": "user", "content": line})
        body = {
            "model": session.model,
            "messages": session.messages(),
            "options": session.options,
            "stream": True,
            **fields,
            **session.request_fields(),
        }
        try:
            reply, final = _stream_text(client, "/api/chat", body, "message", args.hidethinking)
        except ClientError as exc:
            print(f"\nError: {exc}", file=sys.stderr)
            session.history.pop()
            continue
        print("\n")
        if final:  # an answer cut short by Ctrl-C is not kept, as Ollama's chat keeps none
            session.history.append({"role": "assistant", "content": reply})
        if session.verbose and final:
            print_stats(final)


def run_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields `run`'s flags set, as Ollama's CLI sends them: `--format json` is the
    string "json", anything else is sent as the JSON it parses to (a schema) or as given;
    `--think` is true, `--think=false` false, `--think=high` the level."""
    fields: dict[str, Any] = {}
    if args.keepalive:
        fields["keep_alive"] = args.keepalive
    if args.format:
        try:
            fields["format"] = args.format if args.format == "json" else json.loads(args.format)
        except ValueError:
            fields["format"] = args.format
    if args.think is not None:
        fields["think"] = {"true": True, "false": False}.get(args.think.lower(), args.think)
    return fields


def cmd_run(args: argparse.Namespace) -> int:
    client = _client()
    ensure_daemon(client)
    try:
        info = show_or_pull(client, args.model)
    except ClientError as exc:
        return _fail(explain(str(exc)) if exc.status != 404 else str(exc))
    options: dict[str, Any] = {}
    prompt = " ".join(args.prompt)
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        prompt = f"{piped}\n{prompt}".strip("\n") if prompt else piped
    if "embedding" in info.get("capabilities", []):
        return _embed(client, args, prompt)
    if prompt or not sys.stdout.isatty() or not sys.stdin.isatty():
        body: dict[str, Any] = {
            "model": args.model,
            "prompt": prompt,
            "options": options,
            "stream": True,
            **run_fields(args),
        }
        try:
            _, final = _stream_text(client, "/api/generate", body, "response", args.hidethinking)
        except ClientError as exc:
            print(file=sys.stderr)
            return _fail(str(exc))
        print()
        if args.verbose and final:
            print_stats(final)
        return 0
    load = {"model": args.model, "prompt": "", "stream": False, **run_fields(args)}
    try:
        client.post("/api/generate", load)
    except ClientError as exc:
        return _fail(str(exc))
    return interactive(client, args, options)


def _flag(value: str) -> bool:
    """A boolean flag's value as Go's flag package reads one (`--truncate=false`)."""
    lowered = value.lower()
    if lowered in ("1", "t", "true"):
        return True
    if lowered in ("0", "f", "false"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean value {value!r}")


def _embed(client: Client, args: argparse.Namespace, text: str) -> int:
    """`run` on an embedding model, as `ollama run` does it: the text's vector as JSON."""
    if not text:
        return _fail(
            f'embedding models require input text. Usage: mlxd run {args.model} "your text here"'
        )
    body: dict[str, Any] = {"model": args.model, "input": text}
    if args.keepalive:
        body["keep_alive"] = args.keepalive
    if args.truncate is not None:
        body["truncate"] = args.truncate
    if args.dimensions is not None:
        body["dimensions"] = args.dimensions
    try:
        reply = client.post("/api/embed", body)
    except ClientError as exc:
        return _fail(str(exc))
    print(json.dumps(reply["embeddings"][0], separators=(",", ":")))
    return 0


# -- pull, rm, cp ----------------------------------------------------------------------------


class PullProgress:
    """Draws `mlxd pull` progress on stderr from the /api/pull stream.

    On a terminal each digest gets one bar, redrawn in place (`pulling 1a2b3c4d5e6f:  42%
    ▕██████████               ▏ 1.2 MB/2.9 MB`); otherwise plain lines are printed when a file
    starts, at every tenth and when it is done, so logs stay short. Status lines without a
    digest (`pulling manifest`, `verifying sha256 digest`, `success`) print as they come.
    """

    WIDTH = 25

    def __init__(self, out: TextIO | None = None, tty: bool | None = None) -> None:
        self.out = out if out is not None else sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.current: str | None = None  # digest of the bar being drawn
        self.tenth = -1  # plain mode: last tenth printed for the current digest
        self.open = False  # tty mode: a bar is drawn on a line not yet ended

    def update(self, obj: dict[str, Any]) -> None:
        status = str(obj.get("status", ""))
        digest = obj.get("digest")
        if not digest:
            self._end()
            self.current = None
            self.out.write(status + "\n")
        else:
            total = int(obj.get("total") or 0)
            completed = int(obj.get("completed") or 0)
            if digest != self.current:
                self._end()
                self.current, self.tenth = digest, -1
            if self.tty:
                self.out.write("\r" + self._bar(status, total, completed) + "\x1b[K")
                self.open = True
            else:
                tenth = 10 if completed >= total else completed * 10 // total
                if tenth > self.tenth:
                    self.tenth = tenth
                    self.out.write(self._bar(status, total, completed) + "\n")
        self.out.flush()

    def _bar(self, status: str, total: int, completed: int) -> str:
        percent = 100 if completed >= total else completed * 100 // total
        sizes = (
            human_size(total)
            if completed >= total
            else f"{human_size(completed)}/{human_size(total)}"
        )
        if not self.tty:
            return f"{status}: {percent:3d}% {sizes}"
        filled = self.WIDTH * percent // 100
        return f"{status}: {percent:3d}% ▕{'█' * filled}{' ' * (self.WIDTH - filled)}▏ {sizes}"

    def _end(self) -> None:
        if self.open:
            self.out.write("\n")
            self.open = False

    def close(self) -> None:
        self._end()
        self.out.flush()


def pull_model(client: Client, model: str, insecure: bool = False) -> None:
    """POST /api/pull, drawing its progress; an error line raises ClientError."""
    progress = PullProgress()
    try:
        for obj in client.stream("/api/pull", {"model": model, "insecure": insecure}):
            progress.update(obj)
    finally:
        progress.close()


def _hub_name(model: str) -> str | None:
    """The `hf.co/org/repo:tag` name a pull of `org/repo[:tag]` or `hf.co/org/repo[:tag]`
    registers; None for names that cannot be a hub repo (`llama3.2`)."""
    try:
        hub = hub_name(parse_name(model))
    except InvalidModelName:
        return None
    return hub.display if hub is not None else None


def show_or_pull(client: Client, model: str) -> dict[str, Any]:
    """`/api/show` (what the model can do), pulling first when it answers 404, as `ollama run`
    does (a pulled `org/repo` answers to that name)."""
    try:
        return dict(client.post("/api/show", {"model": model}))
    except ClientError as exc:
        if exc.status != 404:
            raise
        missing = exc
    try:
        pull_model(client, model)
    except ClientError as exc:
        if _hub_name(model) is None and "file does not exist" in str(exc):
            raise missing from exc  # neither registered nor a hub repo: say so plainly
        raise
    return dict(client.post("/api/show", {"model": model}))


def cmd_pull(args: argparse.Namespace) -> int:
    client = _client()
    ensure_daemon(client)
    try:
        pull_model(client, args.model, args.insecure)
    except ClientError as exc:
        return _fail(explain(str(exc)))
    return 0


def _delete(client: Client, model: str) -> None:
    client.delete("/api/delete", {"model": model})


def cmd_rm(args: argparse.Namespace) -> int:
    client = _client()
    ensure_daemon(client)
    for model in args.models:
        _delete(client, model)
        print(f"deleted '{model}'")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    client = _client()
    ensure_daemon(client)
    client.post("/api/copy", {"source": args.source, "destination": args.destination})
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def create_body(client: Client, name: str, modelfile: Path) -> dict[str, Any]:
    """The /api/create body for a Modelfile: one ADAPTER directory is uploaded as blobs (so a
    daemon on another machine gets the files), unless it has a scale or the draft has adapters
    (which only the Modelfile's text says); paths are taken relative to the Modelfile."""
    text = modelfile.read_text(encoding="utf-8")
    spec = parse_modelfile(text)
    here = modelfile.resolve().parent

    def local(p: str) -> Path:
        path = Path(p).expanduser()
        return path if path.is_absolute() else here / path

    adapters = [local(a.ref) for a in spec.adapters]
    uploads = spec.adapters[0].scale is None and not spec.draft_adapters if adapters else False
    if len(adapters) == 1 and adapters[0].is_dir() and uploads:  # Ollama's fields say no more
        files = sorted(f for f in adapters[0].iterdir() if f.name in ADAPTER_FILES)
        body: dict[str, Any] = {"model": name, "from": spec.from_}
        body["adapters"] = {f.name: client.upload_blob(f) for f in files}
        for key in ("system", "template"):
            if getattr(spec, key):
                body[key] = getattr(spec, key)
        if spec.parameters:
            body["parameters"] = spec.parameters
        if spec.messages:
            body["messages"] = spec.messages
        if spec.draft:
            body["modelfile"] = f"FROM {spec.from_}\nDRAFT {local(spec.draft)}\n"
        return body
    return {"model": name, "modelfile": text, "path": str(modelfile.resolve())}


def cmd_create(args: argparse.Namespace) -> int:
    client = _client()
    ensure_daemon(client)
    try:
        body = create_body(client, args.model, Path(args.file))
    except (OSError, ModelfileError) as exc:
        return _fail(str(exc))
    except UnicodeDecodeError:
        return _fail(f"{args.file}: a Modelfile is UTF-8 text")
    for line in client.stream("/api/create", body):
        print(line.get("status", ""), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd", description="Serve MLX models with an Ollama-compatible API"
    )
    parser.add_argument("-v", "--version", action="store_true", help="show the version")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("serve", aliases=["start"], help="start the daemon")
    p.add_argument(
        "--registry",
        type=Path,
        default=None,
        help="registry file (default: MLXD_REGISTRY or the packaged models.yaml + $MLXD_HOME/models.yaml)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run", help="run a model (one prompt, piped input, or an interactive chat)")
    p.add_argument("model")
    p.add_argument("prompt", nargs="*")
    p.add_argument("--verbose", action="store_true", help="print timings and draft statistics")
    p.add_argument("--keepalive", default=None, help="how long to keep the model loaded (e.g. 5m)")
    p.add_argument("--format", default=None, help="response format (e.g. json)")
    p.add_argument(
        "--nowordwrap",
        action="store_true",
        help="don't wrap words to the next line (mlxd never wraps; accepted as ollama does)",
    )
    p.add_argument(
        "--think",
        default=None,
        metavar="true|false|high|medium|low",
        help="thinking: --think turns it on, --think=VALUE sets it",
    )
    p.add_argument(
        "--hidethinking", action="store_true", help="don't show a thinking model's thinking"
    )
    p.add_argument(
        "--truncate",
        default=None,
        type=_flag,
        metavar="true|false",
        help="embedding models: cut an input longer than the context (the default);"
        " --truncate=false refuses it instead",
    )
    p.add_argument(
        "--dimensions",
        type=int,
        default=None,
        help="embedding models: the vector's first N dimensions, renormalized",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("list", aliases=["ls"], help="list models")
    p.add_argument("prefix", nargs="?", help="only models whose name starts with this")
    p.add_argument(
        "--pulled", action="store_true", help="only pulled models (leave out registered ones)"
    )
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a model's details")
    p.add_argument("model")
    for field in SHOW_FIELDS:
        p.add_argument(f"--{field}", action="store_true", help=f"show the model's {field}")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("ps", help="list running models")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("stop", help="stop a running model")
    p.add_argument("model")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("pull", help="pull a model from the Hugging Face hub")
    p.add_argument("model", help="a registry name, org/repo or hf.co/org/repo[:revision]")
    p.add_argument("--insecure", action="store_true", help="accepted for ollama compatibility")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("rm", help="remove models")
    p.add_argument("models", nargs="+", metavar="model")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("create", help="create a model from a Modelfile")
    p.add_argument("model")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default: ./Modelfile)")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("cp", help="copy a model")
    p.add_argument("source")
    p.add_argument("destination")
    p.set_defaults(func=cmd_cp)
    return parser


# Flags that, as in Ollama's CLI, take a value only as `--flag=VALUE`: alone they mean "true"
# and never swallow the next word (`mlxd run m --think "why?"`).
OPTIONAL_VALUE_FLAGS = ("--think", "--truncate")


# always take the next word, `-1m` included
VALUE_FLAGS = ("--keepalive", "--format", "--dimensions")


def _bare_flags_true(args: Sequence[str]) -> list[str]:
    """A bare `--think` (`--truncate`) as `--think=true`; `--keepalive -1m` as
    `--keepalive=-1m` (argparse would read a value starting with a dash as a flag; Ollama's
    CLI takes the next word)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + list(args[i:])
        if arg in VALUE_FLAGS and i + 1 < len(args):
            out.append(f"{arg}={args[i + 1]}")
            i += 2
            continue
        out.append(f"{arg}=true" if arg in OPTIONAL_VALUE_FLAGS else arg)
        i += 1
    return out


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Flags anywhere after the subcommand, before or after its positionals
    (`mlxd run tiny "def f(" --verbose`), as Ollama's CLI takes them.

    The top level has only value-less flags, so the command is the first word without a dash;
    its own parser then reads the rest intermixed.
    """
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    at = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if at is None or argv[at] not in commands.choices:
        return parser.parse_args(argv)  # no command, or an unknown one: the usual errors
    args = parser.parse_args(argv[:at])
    args.command = argv[at]
    sub: argparse.ArgumentParser = commands.choices[argv[at]]
    return sub.parse_intermixed_args(_bare_flags_true(argv[at + 1 :]), args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else argv)
    if not args.version and not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return _version() if args.version else int(args.func(args))
    except (ClientError, ConfigError) as exc:
        return _fail(str(exc))
    except httpx.HTTPError as exc:  # the daemon went away mid-command (killed, shut down)
        return _fail(f"lost the connection to the mlxd daemon: {exc}")
    except BrokenPipeError:  # stdout's reader left (`mlxd run ... | head -1`): end quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process ended by SIGPIPE
    except OSError as exc:  # e.g. MLXD_HOME cannot be created
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


def _version() -> int:
    client = _client()
    server = "unknown (daemon not running)"
    if client.heartbeat():
        server = client.get("/api/version").get("version", "?")
    print(f"mlxd version is {VERSION} (API {server})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
