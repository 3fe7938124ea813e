"""Grammar-constrained decoding in the engine: masks in plain decoding, the constrained verify
walk, forced tokens as drafts, solo and batched rows, and the masked distribution."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest

from mlxd.engine import grammar
from mlxd.engine.attention import cuda_available
from mlxd.engine.drafting import DraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.events import Failed
from mlxd.engine.forced import ForcedDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.grammar import (
    CACHED_GRAMMARS,
    GrammarError,
    GrammarSpec,
    Matcher,
    _compiled,
    _unpack,
    _unpack_cuda,
    bias_of,
    closed,
    compile_grammar,
    ll_tokenizer,
    single_token,
    validate,
)
from mlxd.engine.kvcache import make_cache
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.prefill import feed
from mlxd.engine.sampling import Rng, next_tokens, to_int
from mlxd.engine.speculation import DraftLengthController
from tests.engine.conftest import Loaded
from tests.engine.test_rows import opts_of, pairing_of, serve, solo_plain
from tests.engine.test_speculative import CHEAP, chi2_pvalue, tiny_vocab_model
from tests.fixtures.tiny_models import TinyPair

SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 999}
SHORT = {"type": "string", "maxLength": 10}
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": SHORT, "age": SMALL_INT},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "bird"]},
            "tags": {"type": "array", "items": SHORT, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["kind", "tags", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": SMALL_INT, "y": SMALL_INT},
                "required": ["x", "y"],
            },
            "label": {"type": "string", "enum": ["a", "b"]},
        },
        "required": ["point", "label"],
    },
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
]
PROMPT_TEXTS = ["Give me JSON: ", "def f(x):\n    return", "The quick brown fox"]


def matcher(loaded: Loaded, spec: GrammarSpec) -> Matcher:
    eos = sorted(loaded.tokenizer.eos_token_ids)
    return Matcher.build(spec, loaded.tokenizer, loaded.target.args.vocab_size, eos)


def source_of(kind: str, m: Matcher, loaded: Loaded, opts: SamplingOptions, rng: Rng) -> Any:
    inner: DraftSource | None = None
    if kind == "model":
        inner = ModelDraftSource(loaded.draft, opts, rng)
    elif kind == "lookup":
        inner = LookupDraftSource(2, 1)
    return ForcedDraftSource(m, inner)


def decode(
    loaded: Loaded,
    spec: GrammarSpec,
    prompt: list[int],
    opts: SamplingOptions,
    source: str | None = None,
    limit: int = 200,
) -> tuple[list[int], str, Generation]:
    m = matcher(loaded, spec)
    rng = Rng(opts.seed)
    src = source_of(source, m, loaded, opts, rng) if source else None
    controller = DraftLengthController(CHEAP, 4, 0.0) if src else None
    eos = set(loaded.tokenizer.eos_token_ids)
    gen = Generation(loaded.target, prompt, opts, eos, limit, rng, src, controller, grammar=m)
    try:
        gen.prefill()
        out = [t for new in gen for t in new]
        assert gen.finish is not None
        return out, gen.finish, gen
    finally:
        gen.close()


def check_valid(loaded: Loaded, out: list[int], schema: dict[str, Any]) -> Any:
    value = json.loads(loaded.tokenizer.decode(out))
    jsonschema.validate(value, closed(schema))
    return value


@pytest.mark.parametrize("source", ["model", "lookup", "forced"])
def test_greedy_grammar_with_speculation_is_token_identical_to_grammar_alone(
    loaded: Loaded, source: str
) -> None:
    greedy = parse_options({"temperature": 0})
    drafted = 0
    for schema in SCHEMAS:
        spec = GrammarSpec.schema(schema)
        for text in PROMPT_TEXTS:
            prompt = list(loaded.tokenizer.encode(text))
            alone, finish, _ = decode(loaded, spec, prompt, greedy)
            assert finish == "stop"
            check_valid(loaded, alone, schema)
            spec_out, spec_finish, gen = decode(loaded, spec, prompt, greedy, source)
            assert spec_out == alone and spec_finish == "stop"
            drafted += gen.stats.drafted
            assert gen.stats.accepted > 0  # forced tokens at least: braces, quotes, keys
    assert drafted > 0


@pytest.mark.parametrize("source", ["model", "forced"])
def test_seeded_sampling_with_speculation_gives_grammar_alones_tokens(
    loaded: Loaded, source: str
) -> None:
    """Position-keyed noise: the masked target's sample at each position does not depend on
    what was drafted, so a seeded request repeats exactly with speculation."""
    spec = GrammarSpec.schema(SCHEMAS[1])
    prompt = list(loaded.tokenizer.encode(PROMPT_TEXTS[0]))
    outputs = set()
    for seed in range(6):
        opts = parse_options({"temperature": 1.5, "seed": seed})
        alone, _, _ = decode(loaded, spec, prompt, opts)
        check_valid(loaded, alone, SCHEMAS[1])
        assert decode(loaded, spec, prompt, opts, source)[0] == alone
        outputs.add(tuple(alone))
    assert len(outputs) > 1  # the seeds do sample


def one_at_a_time(
    loaded: Loaded, spec: GrammarSpec, prompt: list[int], opts: SamplingOptions, limit: int
) -> list[int]:
    """The grammar-alone decode with nothing overlapped: forward, wait, mask, choose, wait,
    advance the matcher, for every token (forced ones included)."""
    m = matcher(loaded, spec)
    rng, eos = Rng(opts.seed), set(loaded.tokenizer.eos_token_ids)
    cache = make_cache(loaded.target)
    feed(loaded.target, cache, prompt[:-1])
    out: list[int] = []
    last = prompt[-1]
    while len(out) < limit:
        logits = loaded.target(mx.array([[last]]), cache=cache)[0, -1:, :]
        mx.eval(logits)
        bias = m.bias()
        position = len(prompt) + len(out)
        last = to_int(next_tokens(logits, prompt + out, [], opts, rng, position, bias)[0])
        out.append(last)
        if last in eos:
            break
        assert m.consume([last]) == 1
        if m.stopped:
            break
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_overlapped_grammar_decoding_gives_the_one_at_a_time_tokens(
    loaded: Loaded, temperature: float
) -> None:
    """Solo grammar decoding queues each forward before the host computes the mask and
    commits forced tokens without sampling or waiting: the same tokens as decoding one
    token at a time with every step waited for (and as many, cut by the limit)."""
    forced = 0
    for i, schema in enumerate(SCHEMAS):
        spec = GrammarSpec.schema(schema)
        for j, text in enumerate(PROMPT_TEXTS):
            opts = parse_options({"temperature": temperature, "seed": 10 * i + j})
            prompt = list(loaded.tokenizer.encode(text))
            out, finish, gen = decode(loaded, spec, prompt, opts)
            assert finish == "stop"
            assert out == one_at_a_time(loaded, spec, prompt, opts, 200)
            check_valid(loaded, out, schema)
            assert gen.grammar is not None
            forced += gen.grammar.masks_forced
            half = len(out) // 2
            if half:
                cut, finish, _ = decode(loaded, spec, prompt, opts, limit=half)
                assert finish == "length" and cut == out[:half]
    assert forced > 0  # the forced-token path ran (braces, quotes, keys)


@pytest.mark.parametrize("vocab", [5, 70, 8192])
def test_bias_unpacks_the_bitmask_on_either_path(vocab: int) -> None:
    """The host unpack (the CPU's) and the device unpack (a GPU's) give the same
    bias: 0 exactly at the set bits below `vocab`; and a single set bit is the forced token."""
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    bits = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    want = [
        [0.0 if (int(bits[r, t >> 5]) >> (t & 31)) & 1 else -np.inf for t in range(vocab)]
        for r in range(3)
    ]
    assert bias_of(bits, vocab).tolist() == want
    packed = mx.array(bits.view(np.uint32))
    for dtype in (mx.float32, mx.bfloat16):
        assert _unpack(packed, vocab, dtype).tolist() == want
        if cuda_available():  # the one-kernel unpack
            with mx.stream(mx.gpu):
                got = _unpack_cuda(packed, vocab, dtype)
            assert got.dtype == dtype and got.tolist() == want
    one = np.zeros(words, dtype=np.int32)
    one[(vocab - 1) >> 5] = np.int32(np.uint32(1 << ((vocab - 1) & 31)).view(np.int32))
    assert single_token(one) == vocab - 1
    assert single_token(np.zeros(words, dtype=np.int32)) is None
    assert single_token(bits[0]) is None


def test_num_predict_before_the_grammar_completes_ends_with_length(loaded: Loaded) -> None:
    spec = GrammarSpec.schema(SCHEMAS[0])
    prompt = list(loaded.tokenizer.encode(PROMPT_TEXTS[0]))
    whole, _, _ = decode(loaded, spec, prompt, parse_options({"temperature": 0}))
    for source in (None, "forced", "model"):
        cut, finish, _ = decode(
            loaded, spec, prompt, parse_options({"temperature": 0}), source, limit=5
        )
        assert finish == "length" and cut == whole[:5]


def test_lark_and_regex_grammars_end_the_generation(loaded: Loaded) -> None:
    greedy = parse_options({"temperature": 0})
    prompt = list(loaded.tokenizer.encode("x"))
    out, finish, _ = decode(loaded, GrammarSpec("regex", r"(yes|no)-[0-9]{3}"), prompt, greedy)
    text = loaded.tokenizer.decode(out)
    assert finish == "stop" and text[:-4] in ("yes", "no") and text[-4] == "-"
    lark = 'start: "call(" ARG ("," ARG)* ")"\nARG: /[a-z]{1,4}/'
    out, finish, _ = decode(loaded, GrammarSpec("lark", lark), prompt, greedy, "forced")
    text = loaded.tokenizer.decode(out)
    assert finish == "stop" and text.startswith("call(") and text.endswith(")")


def test_batched_rows_each_follow_their_own_grammar(tiny_pair: TinyPair) -> None:
    """Rows with different grammars (and a free one) in one batch, speculating or not: each
    gives exactly its grammar-alone solo output."""
    pairing = pairing_of(tiny_pair)
    loaded = Loaded(pairing.target, pairing.draft, pairing.tokenizer)  # type: ignore[arg-type]
    methods = ["auto", "off", "model", "forced", "lookup", "off"]
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(len(methods))]
    prompts = [
        list(pairing.tokenizer.encode(PROMPT_TEXTS[i % len(PROMPT_TEXTS)]))
        for i in range(len(methods))
    ]
    expected = [
        decode(loaded, GrammarSpec.schema(s), p, parse_options({"temperature": 0}))[0]
        for s, p in zip(schemas, prompts, strict=True)
    ]
    specs = [
        (p, opts_of(temperature=0, num_predict=200, draft_method=m))
        for p, m in zip(prompts, methods, strict=True)
    ]
    grammars = [GrammarSpec.schema(s) for s in schemas[:-1]] + [None]  # the last is free
    done = serve(pairing, specs, grammars=grammars, start_after={4: (0, 3), 5: (1, 2)})
    for i, final in enumerate(done[:-1]):
        assert final.output_tokens == expected[i], methods[i]
        assert final.done_reason == "stop"
        check_valid(loaded, final.output_tokens, schemas[i])
    assert done[-1].done_reason == "length"  # the free row runs to its num_predict


def test_masked_distribution_under_speculation() -> None:
    """Chi-square on a 5-token vocabulary: with a grammar and a free-running draft model,
    pairs of tokens follow the masked target distribution exactly (the second mask depends
    on the first token)."""
    vocab = 5  # a b c d <eos>
    target, draft = tiny_vocab_model(11, vocab), tiny_vocab_model(12, vocab)
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(TinyVocab()))
    regex = "a[bc]|b[ad]|c[abd]|d[a-d]"
    prompt = [1, 3, 2, 1, 3]
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    expected = masked_pairs(target, prompt, regex, vocab)
    counts: Counter[tuple[int, ...]] = Counter()
    trials, drafted = 1500, 0
    for seed in range(trials):
        opts = parse_options({**base, "seed": seed})
        rng = Rng(seed)
        m = Matcher(llguidance.LLMatcher(tok, GrammarSpec("regex", regex).llguidance_grammar()), 5)
        source = ForcedDraftSource(m, ModelDraftSource(draft, opts, rng))
        controller = DraftLengthController(CHEAP, 2, 0.01)
        gen = Generation(target, prompt, opts, {4}, 4, rng, source, controller, grammar=m)
        gen.prefill()
        out = tuple(t for new in gen for t in new)
        assert gen.finish == "stop"
        drafted += gen.stats.drafted
        gen.close()
        counts[out] += 1
    assert drafted >= trials
    assert set(counts) <= set(expected)
    stat, df = 0.0, 0
    for cell, p in expected.items():
        e = p * trials
        if e >= 5:
            stat += (counts[cell] - e) ** 2 / e
            df += 1
    assert df >= 4
    assert chi2_pvalue(stat, df - 1) > 1e-3, (stat, df)


class TinyVocab:
    """A four-letter tokenizer (and EOS) for llguidance, one token per letter."""

    eos_token_id = 4
    bos_token_id = None
    tokens = [b"a", b"b", b"c", b"d", b""]
    special_token_ids = [4]

    def __call__(self, text: bytes) -> list[int]:
        return [b"abcd".index(bytes([c])) for c in text]


def masked_pairs(model: Any, prompt: list[int], regex: str, vocab: int) -> dict[tuple, float]:
    import re

    first = mx.softmax(model(mx.array([prompt]))[0, -1], axis=-1).tolist()
    letters = "abcd"
    ok1 = [i for i in range(4) if any(re.fullmatch(regex, letters[i] + b) for b in letters)]
    z1 = sum(first[i] for i in ok1)
    out = {}
    for a in ok1:
        second = mx.softmax(model(mx.array([[*prompt, a]]))[0, -1], axis=-1).tolist()
        ok2 = [b for b in range(4) if re.fullmatch(regex, letters[a] + letters[b])]
        z2 = sum(second[b] for b in ok2)
        for b in ok2:
            out[(a, b)] = first[a] / z1 * second[b] / z2
    return out


def test_compiled_grammars_are_cached_per_spec_and_tokenizer(loaded: Loaded) -> None:
    vocab = loaded.target.args.vocab_size
    lltok = ll_tokenizer(loaded.tokenizer, vocab, [0])
    assert ll_tokenizer(loaded.tokenizer, vocab, [0]) is lltok
    spec = GrammarSpec.schema({"type": "object", "properties": {"q": SMALL_INT}})
    first = compile_grammar(spec, lltok)
    size = len(_compiled)
    second = compile_grammar(spec, lltok)
    assert len(_compiled) == size and first is not second  # one template, fresh copies
    assert len(_compiled) <= CACHED_GRAMMARS


def test_copies_do_not_share_parser_state(loaded: Loaded) -> None:
    spec = GrammarSpec.schema(SCHEMAS[0])
    a, b = matcher(loaded, spec), matcher(loaded, spec)
    forced = b.forced()
    a.consume(list(loaded.tokenizer.encode('{"age": 12, "name": "')))
    assert b.forced() == forced and a.forced() != forced


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec.schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (GrammarSpec.schema({"type": "wat"}), "wat"),
        (GrammarSpec.schema({"$ref": "#/$defs/missing"}), "missing"),
        (GrammarSpec("regex", "[a-"), "unclosed character class"),
        (GrammarSpec("lark", "start: undefined_rule"), "undefined_rule"),
        (GrammarSpec("json_schema", "{not json"), "json schema"),
    ],
)
def test_bad_grammars_name_the_problem(spec: GrammarSpec, message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        validate(spec)


def test_closed_touches_subschemas_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {}}},
            "e": {"enum": [{"properties": {"x": 1}}]},
        },
        "$defs": {"D": {"properties": {"z": {}}, "additionalProperties": True}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["e"] == {"enum": [{"properties": {"x": 1}}]}
    assert out["$defs"]["D"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is left alone


def test_the_output_writes_keys_in_the_schemas_order(loaded: Loaded) -> None:
    """As Ollama and OpenAI write them: a `reasoning` field declared before `answer` comes
    first."""
    spec = GrammarSpec.schema({
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
        "required": ["reasoning", "answer"],
    })  # fmt: skip
    forced = loaded.tokenizer.decode(matcher(loaded, spec).forced())
    assert forced.startswith('{"reasoning": ')


BASE = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
NAMED = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [BASE, NAMED]},
        {**NAMED, "required": ["name", "id"], "allOf": [{"$ref": "#/$defs/Base"}],
         "$defs": {"Base": BASE}},  # Pydantic's inheritance
        {**NAMED, "anyOf": [BASE, {"type": "object", "properties": {"n": {"type": "number"}}}]},
        {**NAMED, "required": ["name", "id"]},  # a required key it does not list
    ],
)  # fmt: skip
def test_objects_taking_keys_from_several_places_stay_open(schema: dict[str, Any]) -> None:
    validate(GrammarSpec.schema(schema))  # satisfiable as written: never refused
    doc = {"name": "x", "id": 1}
    jsonschema.validate(doc, closed(schema))


def test_alternatives_are_each_closed() -> None:
    """`Optional[Model]`: the object branch is the model's fields, nothing more."""
    out = closed({"anyOf": [BASE, {"type": "null"}]})
    assert out["anyOf"][0]["additionalProperties"] is False


@pytest.mark.parametrize("fmt", ["path", "password", "uri-reference", "json-string", "binary"])
def test_a_format_llguidance_does_not_know_is_an_annotation(fmt: str) -> None:
    schema = {"type": "object", "properties": {"p": {"type": "string", "format": fmt}}}
    validate(GrammarSpec.schema(schema))
    kept = closed({"type": "string", "format": "date"})
    assert kept["format"] == "date"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            GrammarSpec.schema(
                {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
            ),
            "Too many items",
        ),
        (GrammarSpec("lark", "start: " + " | ".join(f'"w{i}"' for i in range(5000))), "items"),
        (GrammarSpec("regex", "a{1000000}"), "too many expressions"),
    ],
    ids=["endless-schema", "wide-rule", "huge-repeat"],
)
def test_grammars_that_cannot_take_a_first_step_are_refused_when_compiled(
    loaded: Loaded, spec: GrammarSpec, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They validate, but llguidance's parser limits stop them at the first token: compiling
    them for a model says so (the API's 400), rather than the request's first token; asked
    again, the refusal is remembered, not found out again."""
    validate(spec)
    steps = []
    first_step = grammar._first_step

    def counted(template: Any, spec: GrammarSpec) -> None:
        steps.append(spec)
        first_step(template, spec)

    monkeypatch.setattr(grammar, "_first_step", counted)
    for _ in range(2):
        with pytest.raises(GrammarError, match=message) as refused:
            matcher(loaded, spec)
        assert "<state>" not in str(refused.value)  # the parser's state dump stays out
    assert len(steps) <= 1  # (none where an earlier test compiled it)


# Any first letter; then a rule wider than llguidance's parser allows: the grammar compiles and
# takes its first step, and fails at its second token.
FAILS_LATER = GrammarSpec(
    "lark", "start: /[a-z]/ wide\nwide: " + " | ".join(f'"w{i}"' for i in range(5000))
)


def test_a_grammar_that_fails_mid_output_ends_its_row_alone(tiny_pair: TinyPair) -> None:
    """Four rows decode together; one's grammar reaches a parser limit after its first token.
    That row ends with a failure its request caused (a 400 at the API), the message free of
    the parser's state; the other rows give their solo outputs, as if it had never run."""
    pairing = pairing_of(tiny_pair)
    loaded = Loaded(pairing.target, pairing.draft, pairing.tokenizer)  # type: ignore[arg-type]
    matcher(loaded, FAILS_LATER)  # compiles, first step included
    prompts = [list(pairing.tokenizer.encode(PROMPT_TEXTS[i % 3])) for i in range(4)]
    specs = [(p, opts_of(temperature=0, num_predict=24, draft_method="off")) for p in prompts]
    failed: dict[int, Failed] = {}
    done = serve(pairing, specs, grammars=[None, FAILS_LATER, None, None], failed=failed)
    assert list(failed) == [1]
    assert failed[1].by_request and "grammar failed" in failed[1].message
    assert "<state>" not in failed[1].message
    for (prompt, opts), final in zip([specs[0], *specs[2:]], done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, 24)
