"""Prompt rendering: chat templates, Ollama's generate semantics, Go-style templates and FIM."""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateSyntaxError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxd.registry.templates import is_go_template


class PromptError(ValueError):
    """The request cannot be rendered for this model (answered with 400)."""


@dataclass(frozen=True)
class FimFormat:
    """Fill-in-the-middle special tokens, prefix-suffix-middle order; `lead`: text between the
    prefix token and the prompt; `end`: the token that ends a fill, where it is not EOS."""

    prefix: str
    suffix: str
    middle: str
    lead: str = ""
    end: str | None = None

    def render(self, prefix: str, suffix: str) -> str:
        return f"{self.prefix}{self.lead}{prefix}{self.suffix}{suffix}{self.middle}"


_FIM_FORMATS = (
    FimFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, StarCoder2
    FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
    FimFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    # CodeLlama, whose pieces carry the space before them: "<PRE> {prefix} <SUF>{suffix} <MID>"
    FimFormat("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", lead=" ", end="\u2581<EOT>"),
    FimFormat("<PRE>", "<SUF>", "<MID>"),  # the same, converted without the spaces
)


def detect_fim(vocab: Mapping[str, int]) -> FimFormat | None:
    for fmt in _FIM_FORMATS:
        if fmt.prefix in vocab and fmt.suffix in vocab and fmt.middle in vocab:
            return fmt
    return None


class BareText(str):
    """Rendered text that holds no special tokens but those it names itself (a FIM prompt, an
    Ollama Go template's, a plain transcript): it is tokenized with the tokenizer's own
    additions (its BOS), as Ollama's runner tokenizes every prompt. A chat template's text
    carries them already (`encode`)."""


# -- Ollama's Go templates (the subset prompts use) -------------------------------------------

_ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.S)
GO_FIELDS = ("System", "Prompt", "Response", "Suffix")  # what Ollama's legacy templates name


def _go_parts(template: str) -> list[tuple[str, str]]:
    """The template as ("text", ...) and ("action", body) parts, `{{-`/`-}}` trimming applied."""
    parts: list[tuple[str, str]] = []
    pos = 0
    for m in _ACTION.finditer(template):
        text = template[pos : m.start()]
        if m.group(1):
            text = text.rstrip()
        if parts and parts[-1][0] == "trim_next":
            parts.pop()
            text = text.lstrip()
        parts.append(("text", text))
        parts.append(("action", m.group(2)))
        if m.group(3):
            parts.append(("trim_next", ""))
        pos = m.end()
    tail = template[pos:]
    if parts and parts[-1][0] == "trim_next":
        parts.pop()
        tail = tail.lstrip()
    parts.append(("text", tail))
    return parts


def render_go_template(
    template: str, values: Mapping[str, str], open_response: bool = False
) -> str:
    """Render `{{ .Field }}`, `{{ if .Field }}…{{ else }}…{{ end }}` with `{{-`/`-}}` trimming.

    That subset covers the prompt templates Ollama users pass to /api/generate and the legacy
    model templates (`.System`, `.Prompt`, `.Response`); anything else is a clear error rather
    than a silently wrong prompt. `open_response`: the turn the model is to write, so the
    template ends where `{{ .Response }}` stands (as Ollama cuts it), not with what closes it.
    """
    parts = _go_parts(template)
    if open_response:
        at = next((i for i, p in enumerate(parts) if p == ("action", ".Response")), None)
        parts = parts if at is None else parts[:at]
    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (parent active, this branch taken)

    def active() -> bool:
        return all(parent and taken for parent, taken in stack)

    for kind, body in parts:
        if kind == "text":
            if active():
                out.append(body)
            continue
        if m2 := re.fullmatch(r"if\s+\.(\w+)", body):
            stack.append((active(), bool(values.get(m2.group(1)))))
        elif body == "else":
            if not stack:
                raise PromptError("template: unexpected {{ else }}")
            parent, taken = stack.pop()
            stack.append((parent, not taken))
        elif body == "end":
            if not stack:
                raise PromptError("template: unexpected {{ end }}")
            stack.pop()
        elif m3 := re.fullmatch(r"\.(\w+)", body):
            if active():
                out.append(values.get(m3.group(1), ""))
        else:
            raise PromptError(f"template: unsupported action {{{{ {body} }}}}")
    if stack and not open_response:
        raise PromptError("template: missing {{ end }}")
    return "".join(out)


_SUBSET = re.compile(rf"(?:if\s+)?\.(?:{'|'.join(GO_FIELDS)})|else|end")


def check_go_template(template: str) -> None:
    """Refuse a Go template mlxd cannot render (PromptError), naming its first action past the
    subset (`range .Messages`, `.Tools`, functions) or its unbalanced blocks."""
    for kind, body in _go_parts(template):
        if kind == "text" and "{{" in body:  # every closed action is a part of its own
            raise PromptError("template: unclosed action (a '{{' without its '}}')")
        if kind == "action" and not _SUBSET.fullmatch(body):
            raise PromptError(
                "template: mlxd renders Ollama templates of {{ .System }}, {{ .Prompt }}, "
                "{{ .Response }} and {{ .Suffix }} with {{ if }}/{{ else }}/{{ end }} on them "
                f"(or a Jinja chat template), not {{{{ {body} }}}}"
            )
    for filled in ("", "x"):
        render_go_template(template, dict.fromkeys(GO_FIELDS, filled))


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' chat templates may use
    (it marks the assistant's tokens for training masks): parsed as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


JINJA = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
)  # as transformers renders chat templates


def check_template(template: str | None) -> None:
    """Refuse (PromptError) a template no request on the model could render: a Go template
    past mlxd's subset (`check_go_template`), or Jinja that does not compile, with its line."""
    if not template:
        return
    if is_go_template(template):
        check_go_template(template)
        return
    error = _jinja_error(template)
    if error is not None:
        raise PromptError(error)


@functools.lru_cache(maxsize=64)
def _jinja_error(template: str) -> str | None:
    """Why `template` does not compile (None: it does). Remembered per template: a registry
    reload checks every entry's, some 20 ms each."""
    try:
        JINJA.from_string(template)  # compiling also finds unknown filters and tests
    except TemplateSyntaxError as exc:  # (TemplateAssertionError among them)
        return f"template: Jinja syntax error on line {exc.lineno}: {exc.message}"
    except SyntaxError as exc:  # what compiles to bad Python (a `break` outside a loop)
        return f"template: Jinja syntax error: {exc.msg}"
    return None


def go_template(template: str | None) -> str | None:
    """A model's template when it is Ollama's Go, which mlxd renders itself; None for none or
    Jinja (that one is the tokenizer's chat template, installed at load)."""
    return template if template and is_go_template(template) else None


def suffix_template(template: str | None) -> str | None:
    """A model's Go template that renders fill-in-the-middle (`{{ .Suffix }}`), as Ollama
    reads a model's `insert` capability from its template; else None."""
    go = go_template(template)
    if go is None or not any(b == ".Suffix" or b == "if .Suffix" for _, b in _go_parts(go)):
        return None
    return go


def inserts(fim: FimFormat | None, template: str | None) -> bool:
    """Whether a model takes a suffix: FIM tokens in its vocabulary or a template for it."""
    return fim is not None or suffix_template(template) is not None


def _collated(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(role, content), consecutive messages of one role joined by a blank line, as Ollama
    collates a conversation before a legacy template renders it."""
    out: list[tuple[str, str]] = []
    for m in messages:
        role, content = str(m.get("role") or "user"), str(m.get("content") or "")
        if out and out[-1][0] == role and role != "tool":
            out[-1] = (role, out[-1][1] + "\n\n" + content)
        else:
            out.append((role, content))
    return out


def render_go_chat(template: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """A conversation through a legacy Go template, as Ollama renders it: one pass of the
    template per turn (its system, prompt and response), the last one open where
    `{{ .Response }}` stands. A template without `.Response` gets it at the end, as Ollama
    appends it."""
    if ".Response" not in {body for kind, body in _go_parts(template) if kind == "action"}:
        template += "{{ .Response }}"
    out: list[str] = []
    turn = {"System": "", "Prompt": "", "Response": ""}

    def flush() -> None:
        out.append(render_go_template(template, turn))
        turn.update(System="", Prompt="", Response="")

    for role, content in _collated(messages):
        if role == "system":
            if turn["Prompt"] or turn["Response"]:
                flush()
            turn["System"] = content
        elif role == "user":
            if turn["Response"]:
                flush()
            turn["Prompt"] = content
        elif role == "assistant":
            turn["Response"] = content
    out.append(render_go_template(template, turn, open_response=True))
    return BareText("".join(out))


# -- chat and generate -------------------------------------------------------------------------


def with_system(messages: Sequence[Mapping[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """Prepend the model's system prompt unless the conversation brings its own."""
    out = [dict(m) for m in messages]
    if system and not (out and out[0].get("role") == "system"):
        out.insert(0, {"role": "system", "content": system})
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    template: str | None = None,
) -> str:
    """The chat template (or a `template` given instead: Jinja, or Ollama's Go) with the
    assistant turn opened; a plain transcript when there is none. A conversation that ends
    with an assistant message leaves that message open for the model to continue (a prefill,
    as Ollama's templates leave the last assistant turn). `tools` and `extra` (e.g.
    `enable_thinking`) go to a Jinja template as it names them."""
    if template and is_go_template(template):
        return render_go_chat(template, messages)
    if _empty_turn(messages):
        messages = messages[:-1]  # an empty assistant turn is the one opened below
    continuing = bool(continued(messages))
    if template or getattr(tokenizer, "chat_template", None):
        chosen = {"chat_template": template} if template else {}
        turn = {"continue_final_message": True} if continuing else {}
        try:
            return str(
                tokenizer.apply_chat_template(
                    list(messages),
                    tools=list(tools) if tools else None,
                    add_generation_prompt=not continuing,
                    tokenize=False,
                    **turn,
                    **chosen,
                    **dict(extra or {}),
                )
            )
        except Exception as exc:  # jinja errors carry the template's own message
            raise PromptError(f"chat template failed: {exc}") from exc
    lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
    return BareText("\n".join(lines if continuing else [*lines, "assistant:"]))


def continued(messages: Sequence[Mapping[str, Any]]) -> str:
    """The assistant's text a conversation ends with, which the model continues (a prefill);
    "" where it ends otherwise (a tool call is no text to continue)."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    if last.get("role") != "assistant" or last.get("tool_calls") or not isinstance(content, str):
        return ""
    return content


def _empty_turn(messages: Sequence[Mapping[str, Any]]) -> bool:
    last = messages[-1] if messages else {}
    return (
        last.get("role") == "assistant" and not last.get("content") and not last.get("tool_calls")
    )


def render_generate(
    tokenizer: Any,
    prompt: str,
    system: str | None,
    template: str | None,
    suffix: str | None,
    fim: FimFormat | None,
    extra: Mapping[str, Any] | None = None,
    model_template: str | None = None,
    seed: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Ollama's /api/generate rendering (the raw case never reaches here): the request's
    `template`, else the model's Go template (`model_template`, see `go_template`), else its
    chat template, of the system prompt, the model's `seed` messages (its MESSAGE lines) and
    the prompt. A suffix takes the request's Go template, else the model's template where it
    renders one (`suffix_template`), else the model's FIM tokens."""
    if suffix:
        if not inserts(fim, model_template):
            raise PromptError("does not support insert")
        if template and not is_go_template(template):
            raise PromptError("a template for a suffix must be a Go template ({{ .Suffix }})")
        chosen = template or suffix_template(model_template)
        if chosen:
            return BareText(render_go_template(chosen, {"Prompt": prompt, "Suffix": suffix}))
        assert fim is not None
        return BareText(fim.render(prompt, suffix))
    template = template or model_template
    opening = [{"role": "system", "content": system}] if system else []
    user = [*opening, *(dict(m) for m in seed), {"role": "user", "content": prompt}]
    if template and is_go_template(template):
        return render_go_chat(template, user)
    if template:  # Jinja: the chat template's language, as /api/show reports it
        return render_chat(tokenizer, user, extra=extra, template=template)
    if getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, user, extra=extra)
    return BareText(f"{system}\n\n{prompt}" if system else prompt)


MEMO_MIN_CHARS = 4096  # shorter texts tokenize in well under a millisecond
MEMO_ENTRIES = 8


class _Memo:
    """The tokens of the last few long texts, per tokenizer: a prompt sent again (a retry, a
    regenerated answer, another sample, an editor re-asking) skips tokenizing, which at 7k
    tokens costs more than restoring its K/V from the prefix cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tokenizer: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, bool], list[int]]]
        self._by_tokenizer = weakref.WeakKeyDictionary()

    def get(self, tokenizer: Any, key: tuple[str, bool]) -> list[int] | None:
        with self._lock:
            seen = self._by_tokenizer.get(tokenizer)
            if seen is None or key not in seen:
                return None
            seen.move_to_end(key)
            return list(seen[key])

    def put(self, tokenizer: Any, key: tuple[str, bool], tokens: list[int]) -> None:
        with self._lock:
            try:
                seen = self._by_tokenizer.setdefault(tokenizer, OrderedDict())
            except TypeError:  # a tokenizer that takes no weak reference is not remembered
                return
            seen[key] = list(tokens)
            while len(seen) > MEMO_ENTRIES:
                seen.popitem(last=False)


_memo = _Memo()


def encode(tokenizer: Any, text: str, specials: bool) -> list[int]:
    """`text`'s tokens, with the tokenizer's own additions (BOS) where `specials` asks for
    them and the text does not open with its BOS already (as mlx-lm's `generate` decides);
    a chat template's text carries its own. Long texts seen lately are not tokenized again."""
    bos = getattr(tokenizer, "bos_token", None)
    add = specials and not (bos and text.startswith(bos))
    key = (text, add)
    if len(text) >= MEMO_MIN_CHARS and (known := _memo.get(tokenizer, key)) is not None:
        return known
    tokens = list(tokenizer.encode(text, add_special_tokens=add))
    if len(text) >= MEMO_MIN_CHARS:
        _memo.put(tokenizer, key, tokens)
    return tokens
