"""What /api and /v1 share before the first token: request checks, acquiring the model,
rendering and tokenizing the prompt."""

from __future__ import annotations

import binascii
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from mlxd.api.errors import ApiError
from mlxd.api.state import ServerState
from mlxd.api.types import Message
from mlxd.engine.grammar import GrammarError, GrammarSpec, row_grammar
from mlxd.engine.manager import Loaded
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import ModelNotPulled, Pairing
from mlxd.engine.prefix_cache import shared_prefix
from mlxd.engine.prompt import (
    BareText,
    PromptError,
    encode,
    go_template,
    render_chat,
    with_system,
)
from mlxd.engine.truncation import Budget, fit
from mlxd.registry.schema import ModelEntry

ROLES = ("system", "user", "assistant", "tool")

log = logging.getLogger(__name__)
T = TypeVar("T")


def request_options(entry: ModelEntry, options: dict[str, Any] | None) -> SamplingOptions:
    """The registry's defaults under the request's options (OptionsError: 400)."""
    return parse_options(entry.options, options)


def check_images(images: Sequence[str] | None, model: str) -> None:
    """Images are refused alike on every route: mlxd serves text-only models (none has
    Ollama's `vision` capability). Data that is not base64 is refused first, as Ollama's
    decoder does."""
    if not images:
        return
    for image in images:
        try:
            binascii.a2b_base64(image.encode("ascii"), strict_mode=True)
        except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
            raise ApiError(400, f"invalid image data: {exc}") from exc
    raise ApiError(400, f"{model} does not support images (it has no vision capability)")


def native_messages(messages: Sequence[Message], model: str = "this model") -> list[dict[str, Any]]:
    """Chat messages as the chat template reads them; roles checked and lower-cased."""
    out = []
    for i, msg in enumerate(messages):
        role = (msg.role or "").lower()
        if role not in ROLES:
            raise ApiError(
                400, f"invalid message at index {i}: role must be one of {', '.join(ROLES)}"
            )
        check_images(msg.images, model)
        clean: dict[str, Any] = {"role": role, "content": msg.content or ""}
        for key in ("tool_calls", "tool_name", "tool_call_id", "thinking"):
            value = getattr(msg, key)
            if value is not None:
                clean[key] = value
        out.append(clean)
    return out


# -- the model and the prompt -------------------------------------------------------------------


async def acquire(
    state: ServerState, entry: ModelEntry, keep_alive: float | None
) -> tuple[Loaded, float]:
    """Hold the model (loading it if needed); QueueFull and ModelUnavailable go to the table."""
    try:
        return await state.manager.acquire(entry, keep_alive)
    except ModelNotPulled as exc:
        raise ApiError(404, f'model "{entry.name}" not found, try pulling it first') from exc


async def with_pairing(
    state: ServerState,
    entry: ModelEntry,
    keep_alive: float | None,
    use: Callable[[Pairing], T],
    what: str = "generate",
) -> T:
    """`use` of the model's pairing, held (loaded if need be) only for that: an embedding
    model is refused first (400, `what` naming the task). Ollama's `_debug_render_only`
    renders the prompt this way, and an empty prompt loads the model."""
    slot, _ = await acquire(state, entry, keep_alive)
    try:
        return use(state.manager.pairing(slot, what))
    finally:
        state.manager.release(slot)


def _after(before: list[int], new: list[int], tokenizer: Any) -> list[int]:
    """`new` as it follows `before`: a BOS a chat template wrote at its start is dropped after
    a `context`, as Ollama reads a context and the next prompt as one text."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return new[1:] if before and new and new[0] == bos else new


HEAD_LOOKAHEAD = 64  # characters past a head's cut that settle how its last token is read


def _whole_tokens(tokenizer: Any, text: str, cut: int, specials: bool) -> list[int]:
    """The tokens of `text[:cut]` that `text` itself is read with: a cut inside a token (the
    `<|` two renderings share before `<|user|>` and `<|assistant|>`, a `<` opening the
    user's own text) drops that token's piece."""
    head = encode(tokenizer, text[:cut], specials)
    read = encode(tokenizer, text[: cut + HEAD_LOOKAHEAD], specials)
    return head[: shared_prefix(head, read)]


def tokenize(
    pairing: Pairing,
    opts: SamplingOptions,
    before: list[int],
    text: str,
    templated: bool,
    head: Callable[[], str] = lambda: "",
    model: str = "",
    truncate: bool = True,
) -> list[int]:
    """The prompt's tokens: `before` (a `context` sent back: the conversation so far) and the
    rendered text. One too long for its row drops the oldest of `before` first, then keeps the
    text's head and its most recent tokens (`engine.truncation`), with a warning in the log,
    as Ollama's runner does; with `truncate` false it is refused instead (400)."""
    budget = Budget.of(pairing.row_context(opts), opts.num_predict, pairing.chars_per_token)
    # a chat template's text has its own BOS; after a `context` (which opens with one) none
    specials = (not templated or isinstance(text, BareText)) and not before
    bos = getattr(pairing.tokenizer, "bos_token_id", None)
    # a `context`'s BOS, which the text after it leaves out: kept where the context is cut
    lead = before[:1] if before and before[0] == bos else []
    new: list[int] | None = None
    if len(text) <= budget.window:
        new = _after(before, encode(pairing.tokenizer, text, specials), pairing.tokenizer)
        if not before and not new:
            raise ApiError(400, "prompt is empty after rendering")
        if len(before) + len(new) <= budget.prompt:
            return before + new
    if not truncate:  # uncut, it may leave less room to answer: refused only past the context
        if new is not None and len(before) + len(new) < budget.context:
            return before + new
        raise ApiError(400, "the input length exceeds the context length")
    if new is None or len(new) > budget.prompt - len(lead):
        start = head()  # rendered only when the prompt must be cut
        # the characters before the request's own content: the start it shares with
        # the rendering that leaves that content out
        cut = shared_prefix(text, start) if start else 0
        head_ids = _whole_tokens(pairing.tokenizer, text, cut, specials)
        kept_head = _after(before, head_ids, pairing.tokenizer)
        body = encode(pairing.tokenizer, text[cut:][-budget.window :], False)
        new = fit(kept_head, body, budget.prompt - len(lead))
    room = budget.prompt - len(lead) - len(new)
    rest = before[len(lead) :]
    tokens = lead + (rest[len(rest) - room :] if room > 0 else []) + new
    log.warning(
        "truncating input prompt of %s: limit=%d prompt=%d characters (+%d context tokens)"
        " new=%d",
        model or pairing.entry.name, budget.context, len(text), len(before), len(tokens),
    )  # fmt: skip
    return tokens


def chat_head(entry: ModelEntry, messages: list[dict[str, Any]]) -> Callable[[Pairing], str]:
    """A chat's head, what truncation keeps first: the template's opening and the system
    messages, rendered alone. With none, the opening a template writes before a first user
    message (a BOS, a default system block), read off a rendering of an empty one: templates
    refuse a conversation of no messages."""
    system = [m for m in with_system(messages, entry.system) if m["role"] == "system"]
    shown = system or [{"role": "user", "content": ""}]
    template = go_template(entry.template)
    return lambda pairing: render_chat(pairing.tokenizer, shown, template=template)


def compile_for(pairing: Pairing, grammar: GrammarSpec) -> None:
    try:
        row_grammar(pairing, grammar)
    except GrammarError as exc:
        raise ApiError(400, str(exc)) from exc


def _render_head(head: Callable[[Pairing], str] | None, pairing: Pairing) -> str:
    """The head's rendering; a template that cannot render it keeps no head."""
    if head is None:
        return ""
    try:
        return head(pairing)
    except (ApiError, PromptError):
        return ""


async def prepare(
    state: ServerState,
    entry: ModelEntry,
    keep_alive: float | None,
    render: Callable[[Pairing], str],
    opts: SamplingOptions,
    before: list[int] | None = None,
    templated: bool = True,
    what: str = "generate",
    head: Callable[[Pairing], str] | None = None,
    grammar: GrammarSpec | Callable[[], GrammarSpec | None] | None = None,
    truncate: bool = True,
) -> tuple[Loaded, float, list[int]]:
    """Acquire the model, render and tokenize the prompt (cut to leave room in its row's
    context; `head` renders what of it is kept first: the request without its content; with
    `truncate` false a prompt that does not fit is refused); the slot is released if that
    fails. `what` ("generate", "chat") names the task an embedding
    model refuses. A grammar (or what `grammar()` gives once `render` has run: one that
    depends on the model's template) is compiled for the model's tokenizer here, off the
    model's thread (which then only copies it)."""
    slot, load_seconds = await acquire(state, entry, keep_alive)
    try:
        pairing = state.manager.pairing(slot, what)  # an embedding model: 400
        text = render(pairing)
        pairing.check_options(opts)
        tokens = await run_in_threadpool(
            tokenize, pairing, opts, before or [], text, templated,
            lambda: _render_head(head, pairing), entry.name, truncate,
        )  # fmt: skip
        spec = grammar() if callable(grammar) else grammar
        if spec is not None:
            await run_in_threadpool(compile_for, pairing, spec)
    except BaseException:
        state.manager.release(slot)
        raise
    return slot, load_seconds, tokens
