"""Structured outputs: a request's grammar, compiled once per tokenizer, and its per-row matcher.

llguidance does the work: it turns a JSON schema, a Lark grammar or a regex into an Earley
parser over the tokenizer's vocabulary, computes the set of tokens allowed next (a bitmask) and
the tokens the grammar forces. A compiled grammar is cached by (spec, tokenizer); each row gets
a cheap copy of the compiled matcher, so rows constrained alike never share parser state.

The mask reaches sampling as an additive bias (0 allowed, -inf not) over the model's logits, so
the same `choose` serves constrained and free decoding, greedy and sampled alike.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import mlx.core as mx
import numpy as np

from mlxd.engine.attention import cuda_available

GrammarKind = Literal["json", "json_schema", "lark", "regex"]
KINDS: tuple[str, ...] = ("json", "json_schema", "lark", "regex")

# Any JSON object: what Ollama's `format: "json"` and OpenAI's `json_object` promise.
ANY_OBJECT = '{"type": "object"}'
# JSON is written in one canonical layout (no free whitespace): a model cannot pad the output
# with whitespace forever, and more of every object is forced (free drafts). A schema's own
# "x-guidance" options override these.
JSON_LAYOUT: dict[str, Any] = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
CACHED_GRAMMARS = 64  # compiled grammars kept per process (least recently used dropped)


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; the message names the problem."""


class GrammarFailed(GrammarError):
    """A row's grammar stopped its output while generating (a parser limit reached, a token it
    refused): the request's own doing, so its row alone ends, with this message."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. `source` is the JSON text of the schema for
    json_schema, the grammar text for lark, the pattern for regex, and ignored for json."""

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}")

    @staticmethod
    def schema(schema: Any) -> GrammarSpec:
        """A json_schema spec from a schema object (its JSON text, keys in the order the
        schema declares them: the order the output writes them in), as `closed` reads it."""
        return GrammarSpec("json_schema", json.dumps(closed(schema)))

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own serialized form (GrammarError when malformed)."""
        try:
            if self.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, JSON_LAYOUT)  # type: ignore[arg-type]
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, JSON_LAYOUT)  # type: ignore[arg-type]
            if self.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.source)
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        except ValueError as exc:
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {exc}") from exc


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
    "additionalItems", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip


# the `format`s llguidance (1.9) constrains; others are annotations, as JSON Schema has them
KNOWN_FORMATS = frozenset(
    ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri")
)


def _merged_refs(schema: Any) -> set[str]:
    """The `$ref`s that stand as `allOf` parts anywhere in `schema`: definitions an object
    takes keys from (Pydantic's inheritance), which must stay open."""
    found: set[str] = set()
    if isinstance(schema, dict):
        parts = schema.get("allOf")
        for part in parts if isinstance(parts, list) else ():
            if isinstance(part, dict) and isinstance(part.get("$ref"), str):
                found.add(part["$ref"])
        for value in schema.values():
            found |= _merged_refs(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= _merged_refs(value)
    return found


def closed(schema: Any, close: bool = True, _open: set[str] | None = None) -> Any:
    """`schema` as mlxd constrains it: every object that lists `properties` but says nothing
    of `additionalProperties` closed to those properties, as Ollama's (llama.cpp's) schema
    grammars and OpenAI's strict mode read a schema (`format=Model.model_json_schema()` gets
    the model's fields, not the extra keys JSON Schema's open default would let a model add);
    and a `format` llguidance does not know left as the annotation it is (Pydantic's `path`,
    `password`; `uri-reference`). An object whose keys come from several places (`allOf`,
    branches adding keys, a `required` name it does not list) stays open, and so do the
    branches it merges. Only subschemas are visited (never `enum`, `const` or `default`)."""
    if not isinstance(schema, dict):
        return schema
    opened = _merged_refs(schema) if _open is None else _open
    out = dict(schema)
    props = out.get("properties")
    # allOf's parts are one object's; anyOf/oneOf's branches add keys to listed properties
    # (else they are alternatives, each closed)
    merged = {"allOf"} | ({"anyOf", "oneOf"} if isinstance(props, dict) else set())
    merges = any(isinstance(out.get(key), list) for key in merged)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: closed(sub, f"#/{key}/{name}" not in opened, opened)
                for name, sub in out[key].items()
            }
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub, key not in merged, opened) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = (
                [closed(sub, True, opened) for sub in out[key]]
                if isinstance(out[key], list)
                else closed(out[key], True, opened)
            )
    if isinstance(out.get("format"), str) and out["format"] not in KNOWN_FORMATS:
        del out["format"]
    listed = set(props) if isinstance(props, dict) else set()
    required = out.get("required")
    unlisted = isinstance(required, list) and not set(map(str, required)) <= listed
    open_keys = merges or unlisted or "additionalProperties" in out
    if close and isinstance(props, dict) and not open_keys:
        out["additionalProperties"] = False
    return out


def validate(spec: GrammarSpec) -> None:
    """Compile `spec` without a tokenizer, raising GrammarError naming what is wrong (what the
    API checks before it answers, so a bad schema is a 400 rather than a failed stream)."""
    problem = _problem(spec)
    if problem:
        raise GrammarError(problem)


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _problem(spec: GrammarSpec) -> str:
    """What is wrong with `spec` ("" when nothing); remembered, as clients repeat schemas."""
    try:
        grammar = spec.llguidance_grammar()
    except GrammarError as exc:
        return str(exc)
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return f"invalid {spec.kind.replace('_', ' ')}: {_clean(messages[0])}" if error else ""


def _clean(message: str) -> str:
    """One line, without the parser state llguidance appends to its errors."""
    return " ".join(message.split("<state>")[0].split())


# -- tokenizers and compiled grammars ----------------------------------------------------------


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face fast tokenizer under mlx-lm's wrapper (or the tokenizer itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = (
    weakref.WeakKeyDictionary()
)
_compiled: OrderedDict[tuple[GrammarSpec, int], tuple[Any, Any]] = OrderedDict()


def ll_tokenizer(tokenizer: Any, vocab: int, eos: Sequence[int]) -> Any:
    """llguidance's view of `tokenizer` with `vocab` mask entries (the model's logits width,
    which may exceed the tokenizer's) and the pairing's EOS ids; built once (about a second
    for a large vocabulary) and kept as long as the tokenizer lives."""
    hf = _hf_tokenizer(tokenizer)
    key = (vocab, tuple(sorted(eos)))
    with _lock:
        per = _tokenizers.setdefault(hf, {})
        found = per.get(key)
    if found is not None:
        return found
    import llguidance.hf

    try:
        built = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=sorted(eos) or None)
    except Exception as exc:  # e.g. a slow (Python) tokenizer, which llguidance cannot read
        raise GrammarError(f"structured outputs are not available for this model: {exc}") from exc
    with _lock:
        return per.setdefault(key, built)


def compile_grammar(spec: GrammarSpec, lltok: Any) -> Any:
    """A fresh matcher for `spec` over `lltok`, copied from the cached compiled one. A grammar
    refused is remembered as refused: finding out may take a parser most of a second."""
    key = (spec, id(lltok))
    with _lock:
        hit = _compiled.get(key)
        if hit is not None and hit[0] is lltok:
            _compiled.move_to_end(key)
            if isinstance(hit[1], str):
                raise GrammarError(hit[1])
            return hit[1].deep_copy()
    template = llguidance.LLMatcher(lltok, spec.llguidance_grammar(), log_level=0)
    refused = ""
    try:
        _first_step(template, spec)
    except GrammarError as exc:
        refused = str(exc)
    with _lock:
        _compiled[key] = (lltok, refused or template)  # holding lltok keeps its id unique
        while len(_compiled) > CACHED_GRAMMARS:
            _compiled.popitem(last=False)
    if refused:
        raise GrammarError(refused)
    return template.deep_copy()


def _first_step(template: Any, spec: GrammarSpec) -> None:
    """Raise GrammarError where `template` cannot take its first step: a copy consumes the
    tokens it forces and computes the mask after them. Grammars that validate can still fail
    there (a schema no finite output satisfies, a rule of 5,000 alternatives, `a{1000000}`:
    llguidance's parser limits), and would otherwise fail at the request's first token."""
    problem = template.get_error() if template.is_error() else ""
    if not problem:
        probe = template.deep_copy()
        probe.try_consume_tokens(probe.compute_ff_tokens())
        if not probe.is_error():
            probe.compute_bitmask()
        problem = probe.get_error() if probe.is_error() else ""
    if problem:
        raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {_clean(problem)}")


def logits_width(config: dict[str, Any], tokenizer: Any) -> int:
    """How many logits the model produces: its configured vocabulary (text models and
    multimodal ones alike), else the tokenizer's."""
    for where in (config, config.get("text_config") or {}):
        if isinstance(where.get("vocab_size"), int):
            return int(where["vocab_size"])
    return len(_hf_tokenizer(tokenizer))


def row_grammar(pairing: Any, spec: GrammarSpec | None) -> Matcher | None:
    """A fresh matcher for a request's grammar on `pairing` (None without one)."""
    if spec is None:
        return None
    vocab = logits_width(pairing.config, pairing.tokenizer)
    return Matcher.build(spec, pairing.tokenizer, vocab, sorted(pairing.eos_ids))


# -- the per-row matcher -----------------------------------------------------------------------


class Matcher:
    """One row's parser state: which tokens may come next, and what the row committed.

    `consume` and `rollback` move it with the committed tokens (and, inside a verify walk,
    tentatively over drafts); `masks` and `bias` give the allowed set to sampling."""

    def __init__(self, inner: Any, vocab: int) -> None:
        self.inner = inner
        self.vocab = vocab
        self.words = (vocab + 31) // 32
        self.mask_seconds = 0.0  # host time spent computing masks (bench and metrics)
        self.masks_computed = 0
        self.bias_seconds = 0.0  # host time spent turning masks into biases (bench)
        self.masks_forced = 0  # masks that allowed exactly one token (no sampling needed)
        self._moves = 0  # bumped by every consume and rollback: keys the forced-token memo
        self._forced: tuple[int, list[int]] = (-1, [])
        self._row = self.bits()  # reused by `next_mask`: the bias copies it to the device

    @staticmethod
    def build(spec: GrammarSpec, tokenizer: Any, vocab: int, eos: Sequence[int]) -> Matcher:
        return Matcher(compile_grammar(spec, ll_tokenizer(tokenizer, vocab, eos)), vocab)

    # state

    @property
    def accepting(self) -> bool:
        """The output so far is complete: EOS may end it here."""
        return bool(self.inner.is_accepting())

    @property
    def stopped(self) -> bool:
        """No token but EOS can follow (the grammar ended, or the parser failed)."""
        return bool(self.inner.is_stopped())

    @property
    def error(self) -> str:
        return _clean(str(self.inner.get_error())) if self.inner.is_error() else ""

    # moving

    def consume(self, tokens: Sequence[int]) -> int:
        """Advance over the leading `tokens` the grammar allows; how many it took."""
        if not tokens:
            return 0
        self._moves += 1
        return int(self.inner.try_consume_tokens(list(tokens)))

    def rollback(self, count: int) -> None:
        if count <= 0:
            return
        self._moves += 1
        if not self.inner.rollback(count):
            raise RuntimeError(f"grammar rollback failed: {self.inner.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (may be empty);
        asked by the forced-token draft source, once per matcher state."""
        if self._forced[0] != self._moves:
            found = [] if self.inner.is_stopped() else self.inner.compute_ff_tokens()
            self._forced = (self._moves, [int(t) for t in found])
        return list(self._forced[1])

    def allows(self, token: int) -> bool:
        return int(self.inner.validate_tokens([token])) == 1

    # masks

    def mask_into(self, out: np.ndarray) -> None:
        """Fill one int32 row of `(vocab + 31) // 32` words with the allowed-token bits."""
        t0 = time.perf_counter()
        self.inner.unsafe_compute_mask_ptr(out.ctypes.data, out.size * out.itemsize)
        self.mask_seconds += time.perf_counter() - t0
        self.masks_computed += 1

    def bits(self, rows: int = 1) -> np.ndarray:
        """An (rows, words) int32 buffer for `mask_into`, every token allowed."""
        return np.full((rows, self.words), -1, dtype=np.int32)

    def next_mask(self) -> tuple[np.ndarray, int | None]:
        """The mask for the next token, in a (1, words) buffer reused from call to call (valid
        until the next call), and the token it allows when it allows exactly one: a forced
        token is known on the host, so it needs neither the logits nor a sample."""
        self.mask_into(self._row[0])
        only = single_token(self._row[0])
        if only is not None:
            self.masks_forced += 1
        return self._row, only

    def bias_of(self, bits: np.ndarray, dtype: mx.Dtype = mx.float32) -> mx.array:
        """`bias_of` over this matcher's vocabulary, its host time counted."""
        t0 = time.perf_counter()
        out = bias_of(bits, self.vocab, dtype)
        self.bias_seconds += time.perf_counter() - t0
        return out

    def bias(self) -> mx.array:
        """(1, vocab) additive bias for the next token: 0 where allowed, -inf elsewhere."""
        return self.bias_of(self.next_mask()[0])


def single_token(row: np.ndarray) -> int | None:
    """The one token a mask row allows, or None when it allows none or several (a few
    microseconds: one scan of vocab/32 words, no per-token loop)."""
    nonzero = np.flatnonzero(row)
    if len(nonzero) != 1:
        return None
    word = int(row[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


# bit i of a mask word is token 32 * word + i; materialized host data, so any thread's stream
# may read it
_SHIFTS = mx.array(np.arange(32, dtype=np.uint32))


def _unpack(words: mx.array, vocab: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    rows = words.shape[0]
    allowed = ((words[:, :, None] >> _SHIFTS) & 1).reshape(rows, -1)[:, :vocab]
    return mx.where(allowed, 0.0, -mx.inf).astype(dtype)


_UNPACK_SOURCE = """
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t vocab = VOCAB;
    if (i >= words_shape[0] * vocab) return;
    const size_t row = i / vocab, token = i % vocab;
    const unsigned int word = words[row * words_shape[1] + (token >> 5)];
    const float bias = ((word >> (token & 31)) & 1u) ? 0.0f : __int_as_float(0xff800000);
    out[i] = static_cast<T>(bias);
"""
_unpack_kernel: Any = None


def _unpack_cuda(words: mx.array, vocab: int, dtype: mx.Dtype) -> mx.array:
    """`_unpack` in one kernel: a masked step's choice is a handful of launches, each of which
    costs the host more than the device (the operations took 6, with three scalar uploads)."""
    global _unpack_kernel
    if _unpack_kernel is None:
        _unpack_kernel = mx.fast.cuda_kernel(
            name="mlxd_grammar_bias", input_names=["words"], output_names=["out"],
            source=_UNPACK_SOURCE,
        )  # fmt: skip
    rows = words.shape[0]
    threads = 256
    (out,) = _unpack_kernel(
        inputs=[words], template=[("T", dtype), ("VOCAB", vocab)],
        grid=(-(-rows * vocab // threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(rows, vocab)], output_dtypes=[dtype],
    )  # fmt: skip
    return out


def bias_of(bits: np.ndarray, vocab: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """Bitmask rows (R, words) as an additive (R, vocab) bias in `dtype` (the logits' own: no
    cast when it is added). On a GPU it is unpacked there, lazily: only vocab/32 words cross
    from the host; on MLX's CUDA build in one kernel (not `mx.compile`d operations: on an H200
    the compiled unpack made grammar decoding 3x slower). On the CPU the device is the host:
    numpy unpacks it in two vectorized passes and the bias is one ready array (five small MLX
    operations cost more there). No loop visits the vocabulary."""
    if mx.default_device().type == mx.DeviceType.gpu:
        words = mx.array(bits.view(np.uint32))
        return (_unpack_cuda if cuda_available() else _unpack)(words, vocab, dtype)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab, bitorder="little")
    zero, masked = np.float32(0.0), np.float32(-np.inf)
    return mx.array(np.where(allowed, zero, masked)).astype(dtype)


@dataclass(frozen=True)
class Walk:
    """A verify walk's masks: row i is the grammar's mask after the first i drafts, and
    `consumed` drafts were taken into the matcher (the walk stops at the first draft the
    grammar refuses, or where the grammar ends)."""

    bias: mx.array  # (n + 1, vocab); rows past the stop allow everything (never decided on)
    consumed: int


def walk(matcher: Matcher, drafts: Sequence[int]) -> Walk:
    """Advance `matcher` tentatively over `drafts`, masking each position before it: what the
    verifier needs to choose the masked target's token at every drafted position. The caller
    settles the matcher on the accepted count (`settle`)."""
    buf = matcher.bits(len(drafts) + 1)
    consumed = 0
    for i in range(len(drafts) + 1):
        matcher.mask_into(buf[i])
        if i == len(drafts) or matcher.stopped:
            break
        tok = drafts[i]
        if not (0 <= tok < matcher.vocab) or not (int(buf[i, tok >> 5]) >> (tok & 31)) & 1:
            break
        if matcher.consume([tok]) != 1:
            break
        consumed += 1
    return Walk(matcher.bias_of(buf), consumed)


def settle(matcher: Matcher, walked: Walk, accepted: int) -> int:
    """Roll the matcher back over the walked drafts the verifier rejected; how many of the
    accepted drafts it holds (the committed tokens after those are consumed one by one)."""
    kept = min(accepted, walked.consumed)
    matcher.rollback(walked.consumed - kept)
    return kept
