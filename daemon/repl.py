"""The slash commands of `mlxd run`'s interactive chat, as Ollama's REPL has them.

A `Session` holds what the chat sends with every turn (model, system message, parameters,
history); `command` handles one `/...` line against it. Parameters are typed as Ollama's CLI
types them (numbers, booleans, `stop` as a list) and sent as the request's `options`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxd.daemon.client import Client, ClientError
from mlxd.registry.modelfile import parameter_value
from mlxd.registry.schema import check_option

SET_HELP = """Available Commands:
  /set parameter NAME VALUE   Set a parameter (num_ctx, temperature, stop, ...)
  /set system MESSAGE         Set the system message (\"\"\" for several lines)
  /set format json | noformat Answer in JSON, or as the model likes
  /set think | nothink        Turn thinking on or off (thinking models)
  /set verbose | quiet        Show or hide timings after each answer
  /set history | nohistory    Keep the lines typed for the arrow keys, or not
  /set wordwrap | nowordwrap  Accepted as ollama does (mlxd never wraps)"""

SHOW_HELP = """Available Commands:
  /show info | modelfile | parameters | system | template | license"""

HELP = """Available Commands:
  /set ...                    Set a session setting (/set alone lists them)
  /show info | modelfile | parameters | system | template | license
  /load MODEL                 Load a session or model
  /save MODEL                 Save the session as a model
  /clear                      Clear the session context
  /bye                        Exit
  /?, /help                   Help for a command

Use \"\"\" to begin a multi-line message."""


@dataclass
class Session:
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    verbose: bool = False
    format: Any = None  # the request's `format` ("json", a schema), None: none
    think: Any = None  # the request's `think` (True, False, a level), None: the model's way

    def messages(self) -> list[dict[str, Any]]:
        """What a chat turn sends: the system message first, then the conversation."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def request_fields(self) -> dict[str, Any]:
        """The turn's `format` and `think`, where the session sets them."""
        fields = {"format": self.format, "think": self.think}
        return {k: v for k, v in fields.items() if v is not None}


def system_block(line: str) -> str | None:
    """What follows `/set system` where it opens a \"\"\" block (several lines); None else."""
    words = line.split(maxsplit=2)
    if words[:2] != ["/set", "system"] or len(words) < 3 or not words[2].startswith('"""'):
        return None
    return words[2]


def set_system(session: Session, text: str) -> None:
    session.system = text.strip() or None
    print("Set system message.")


def parse_value(name: str, words: list[str]) -> Any:
    """A parameter's value as Ollama's CLI types it (`stop` takes every word as one stop);
    ValueError for an unknown name or a value of the wrong type, caught before any turn."""
    if name == "stop":
        return words
    value = parameter_value(name, " ".join(words))
    try:
        return check_option(name, value)
    except ValueError as exc:
        raise ValueError(f"invalid value for parameter '{name}': {exc}") from None


def _quoted(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)


def parameters_text(session: Session, shown: str) -> str:
    lines = []
    if shown:
        lines += ["Model defined parameters:", shown, ""]
    if session.options:
        lines.append("User defined parameters:")
        for key, value in session.options.items():
            for v in value if isinstance(value, list) else [value]:
                lines.append(f"{key:<30} {_quoted(v)}")
    if not lines:
        return "No parameters were specified for this model."
    return "\n".join(lines).rstrip("\n")


def _without(modelfile: str, params: set[str], system: bool) -> list[str]:
    """The model's Modelfile lines less the PARAMETERs named in `params` and, with `system`,
    its SYSTEM statement (which may span lines)."""
    out: list[str] = []
    in_system = False
    for line in modelfile.rstrip("\n").splitlines():
        if in_system:
            in_system = not line.endswith('"""')
            continue
        if system and line.startswith("SYSTEM "):
            rest = line[len("SYSTEM ") :]
            in_system = rest.startswith('"""') and (len(rest) < 6 or not rest.endswith('"""'))
            continue
        words = line.split()
        if len(words) >= 2 and words[0] == "PARAMETER" and words[1] in params:
            continue
        out.append(line)
    return out


def modelfile_text(session: Session, shown: str) -> str:
    """The model's Modelfile with the session's settings in place of the model's own, as
    Ollama's `/show modelfile` merges them."""
    lines = _without(shown, set(session.options), bool(session.system))
    if session.system:
        lines.append(f'SYSTEM """{session.system}"""')
    for key, value in session.options.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"PARAMETER {key} {_quoted(v)}")
    return "\n".join(lines)


def _show(client: Client, session: Session, what: str, show_info: Callable[[dict], None]) -> None:
    info = client.post("/api/show", {"model": session.model})
    if what == "info":
        show_info(info)
    elif what == "modelfile":
        print(modelfile_text(session, str(info.get("modelfile", ""))))
    elif what == "parameters":
        print(parameters_text(session, str(info.get("parameters", ""))))
    elif what == "system":
        print(
            session.system
            or info.get("system")
            or "No system message was specified for this model."
        )
    elif what == "template":
        print(info.get("template") or "No prompt template was specified for this model.")
    elif what == "license":
        print(info.get("license") or "No license was specified for this model.")
    else:
        print(f"Unknown command '/show {what}'. Type /? for help")


def _history(on: bool) -> None:
    try:
        import readline
    except ImportError:
        return
    readline.set_auto_history(on)


def _set(session: Session, words: list[str]) -> None:
    what = words[0] if words else ""
    if not what:
        print(SET_HELP)
    elif what == "parameter" and len(words) >= 3:
        name = words[1]
        try:
            session.options[name] = parse_value(name, words[2:])
        except ValueError as exc:
            print(f"Couldn't set parameter: {exc}")
            return
        shown = ", ".join(words[2:]) if name == "stop" else " ".join(words[2:])
        print(f"Set parameter '{name}' to '{shown}'")
    elif what == "parameter":
        print("Usage:\n  /set parameter NAME VALUE")
    elif what == "system":
        set_system(session, " ".join(words[1:]).strip().strip('"'))
    elif what in ("verbose", "quiet"):
        session.verbose = what == "verbose"
        print("Set 'verbose' mode." if session.verbose else "Set 'quiet' mode.")
    elif what == "format" and words[1:] == ["json"]:
        session.format = "json"
        print("Set format to 'json' mode.")
    elif what == "format":
        print("Usage:\n  /set format json")
    elif what == "noformat":
        session.format = None
        print("Disabled format.")
    elif what in ("think", "nothink"):
        session.think = what == "think"
        print(f"Set '{what}' mode.")
    elif what in ("history", "nohistory"):
        _history(what == "history")
        print(f"Set '{what}' mode.")
    elif what in ("wordwrap", "nowordwrap"):
        print(f"Set '{what}' mode.")
    else:
        print(f"Unknown command '/set {what}'. Type /? for help")


def _load(client: Client, session: Session, name: str) -> None:
    print(f"Loading model '{name}'")
    client.post("/api/show", {"model": name})  # 404 before anything changes
    client.post("/api/generate", {"model": name, "prompt": "", "stream": False})
    session.model = name  # a new session: nothing of the old one's is sent again
    session.history = []
    session.system = None
    session.options = {}


def _save(client: Client, session: Session, name: str) -> None:
    """Ollama's /save: POST /api/create from the session (model, system, parameters, history)."""
    body: dict[str, Any] = {"model": name, "from": session.model, "stream": False}
    if session.system:
        body["system"] = session.system
    if session.options:
        body["parameters"] = session.options
    if session.history:
        body["messages"] = session.history
    try:
        client.post("/api/create", body)
    except ClientError as exc:
        if exc.status in (404, 405) and "page not found" in str(exc).lower():
            raise ClientError("this server cannot save models (it has no /api/create)") from exc
        raise
    print(f"Created new model '{name}'")


def command(client: Client, session: Session, line: str, show_info: Callable[[dict], None]) -> bool:
    """Handle one slash-command line; False when the chat should end."""
    words = line.split()
    head, rest = words[0], words[1:]
    try:
        if head in ("/bye", "/exit"):
            return False
        if head in ("/?", "/help"):
            print(HELP)
        elif head == "/clear":
            session.history.clear()
            print("Cleared session context")
        elif head == "/set":
            _set(session, rest)
        elif head == "/show" and not rest:
            print(SHOW_HELP)
        elif head == "/show":
            _show(client, session, rest[0], show_info)
        elif head == "/load" and len(rest) == 1:
            _load(client, session, rest[0])
        elif head == "/save" and len(rest) == 1:
            _save(client, session, rest[0])
        elif head in ("/load", "/save"):
            print(f"Usage:\n  {head} <modelname>")
        else:
            print(f"Unknown command '{head}'. Type /? for help")
    except ClientError as exc:
        print(f"error: {exc}")
    return True
