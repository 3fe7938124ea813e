"""Structured outputs, side by side in one run: unconstrained plain decoding, grammar alone, and
grammar x speculation (draft model, prompt lookup, forced tokens alone), on a JSON-extraction
workload of 24 schemas; plus the mask cost per token as a share of a decode step.

    python bench/grammar.py [--pair /work/shared/models/code-pair] [--tokens 160] [--temps 0,0.7]
    python bench/grammar.py --tiny --methods grammar,plain   # host overhead's stress case

`--tiny` runs the random-weight test models (a decode step well under a millisecond, as a big
model's is on a fast GPU relative to the host): there every host millisecond per token shows.

Every method decodes the same prompts; constrained methods stop where the grammar completes
(or at --tokens), and unconstrained plain decoding runs exactly as many tokens as grammar alone
committed for that prompt, so the rates (committed tokens per second, prompt prefill included)
compare like with like; "decode tok/s" leaves out prefill and the matcher's setup. At
temperature 0 the run checks that every grammar x speculation output is token-identical to
grammar alone. The mask cost is the host time the matcher spends computing masks and the bias
cost the host time turning them into biases, per committed token and as a share of a plain
decode step (the host overlaps both with the forward, so the end-to-end cost is the
grammar-alone / plain ratio); "host ms/tok" is the decoding thread's own CPU time per token
(graph building, masks, biases, bookkeeping: what a fast GPU waits for once the host falls
behind, and a measure that a busy machine's scheduling does not blur); "forced" is the share of masks that allowed a single token
(committed without sampling or waiting).
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

BACKEND = configure_backend()  # first, as `mlxd serve` does: the CPU BLAS goes under MLX

# isort: split
import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.drafting import DraftSource, HybridDraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.forced import ForcedDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.grammar import GrammarSpec, Matcher, logits_width
from mlxd.engine.kvcache import make_cache
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import draft_cap, load_model, measure_costs, warm_up
from mlxd.engine.prefill import feed
from mlxd.engine.prompt import render_chat
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import Costs, DraftLengthController, SpecHistory

S = {"type": "string", "maxLength": 24}
I = {"type": "integer", "minimum": 0, "maximum": 100000}  # noqa: E741
N = {"type": "number", "minimum": 0, "maximum": 100000}
B = {"type": "boolean"}
DATE = {"type": "string", "pattern": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}


def obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props)}


def arr(items: dict[str, Any], most: int = 4) -> dict[str, Any]:
    return {"type": "array", "items": items, "maxItems": most}


def enum(*values: str) -> dict[str, Any]:
    return {"enum": list(values)}


# (what to extract, the text, the schema): a typical extraction workload's shapes.
SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Ada Lovelace, 36, mathematician in London.", obj(name=S, age=I, city=S, job=S)),
    ("address", "221B Baker Street, London NW1 6XE, UK", obj(street=S, city=S, postcode=S, country=S)),
    ("invoice", "Invoice 1042 from Acme, 3 items, total 99.50 EUR, due 2024-05-01.",
     obj(number=I, vendor=S, items=I, total=N, currency=enum("EUR", "USD", "GBP"), due=DATE)),
    ("event", "PyCon 2024 runs May 15-23 in Pittsburgh.", obj(name=S, start=DATE, end=DATE, city=S)),
    ("product", "Widget X, $19.99, in stock, colors red and blue.",
     obj(name=S, price=N, in_stock=B, colors=arr(enum("red", "blue", "green", "black")))),
    ("contact", "Call Bob at 555-0101 or bob@example.com.", obj(name=S, phone=S, email=S)),
    ("sentiment", "The update broke my build. Terrible.",
     obj(sentiment=enum("positive", "negative", "neutral"), confidence=N)),
    ("flight", "UA 925 SFO to LHR departs 2024-07-02, seat 31C.",
     obj(airline=S, number=I, origin=S, destination=S, date=DATE, seat=S)),
    ("recipe", "Pancakes: flour, eggs, milk. 20 minutes.", obj(title=S, ingredients=arr(S), minutes=I)),
    ("weather", "Berlin: 21C, cloudy, wind 12 km/h.",
     obj(city=S, celsius=N, sky=enum("sunny", "cloudy", "rain", "snow"), wind_kmh=N)),
    ("order", "Order 77: 2x mug, 1x tee, shipped.",
     obj(id=I, lines=arr(obj(sku=S, qty=I), 3), status=enum("pending", "shipped", "delivered"))),
    ("meeting", "Standup with Ana and Li at 09:30 on 2024-03-04.",
     obj(title=S, people=arr(S), date=DATE, time=S)),
    ("bug", "Crash on save when the path has spaces; severity high.",
     obj(title=S, severity=enum("low", "medium", "high"), component=S, reproducible=B)),
    ("book", "Dune by Frank Herbert, 1965, 412 pages.", obj(title=S, author=S, year=I, pages=I)),
    ("company", "Globex, founded 1989, 1200 staff, HQ Springfield.",
     obj(name=S, founded=I, employees=I, hq=S)),
    ("transaction", "Paid 42.10 to Corner Cafe by card on 2024-02-11.",
     obj(amount=N, payee=S, method=enum("card", "cash", "transfer"), date=DATE)),
    ("movie", "Alien (1979), directed by Ridley Scott, rated R, 117 min.",
     obj(title=S, year=I, director=S, rating=enum("G", "PG", "PG-13", "R"), minutes=I)),
    ("job", "Senior Python dev, remote, 120k-150k USD.",
     obj(title=S, remote=B, salary=obj(low=I, high=I, currency=enum("USD", "EUR")))),
    ("medication", "Ibuprofen 200 mg twice daily for 5 days.",
     obj(drug=S, dose_mg=I, per_day=I, days=I)),
    ("geo", "Eiffel Tower at 48.8584 N, 2.2945 E.", obj(name=S, lat=N, lon=N)),
    ("review", "4 stars: fast shipping, poor packaging.",
     obj(stars=I, pros=arr(S, 3), cons=arr(S, 3))),
    ("tasks", "Todo: fix login (high), write docs (low).",
     obj(tasks=arr(obj(title=S, priority=enum("low", "medium", "high")), 4))),
    ("citation", "Vaswani et al. 2017, Attention Is All You Need, NeurIPS.",
     obj(authors=arr(S, 3), year=I, title=S, venue=S)),
    ("classify", "Ticket: cannot reset password.",
     obj(category=enum("billing", "account", "bug", "feature"), urgent=B, summary=S)),
]  # fmt: skip


@dataclass
class Row:
    method: str
    temperature: float
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    decode_seconds: float = 0.0
    host_seconds: float = 0.0  # the decoding thread's own CPU time
    masks: int = 0
    mask_seconds: float = 0.0
    bias_seconds: float = 0.0
    forced: int = 0
    valid: int = 0
    requests: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_rate(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds else 0.0


# grammar alone first: unconstrained plain decoding then runs as many tokens as it committed
METHODS = ["grammar", "plain", "grammar+model", "grammar+lookup", "grammar+forced", "grammar+auto"]


def source_for(
    method: str, m: Matcher | None, draft: nn.Module, opts: SamplingOptions, rng: Rng
) -> tuple[DraftSource | None, float]:
    """The method's draft source and its per-token draft cost (0 for free sources)."""
    if m is None or method == "grammar":
        return None, 0.0
    arm = method.split("+")[1]
    if arm == "forced":
        return ForcedDraftSource(m), 0.0
    if arm == "lookup":
        return ForcedDraftSource(m, LookupDraftSource()), 0.0
    if arm == "model":
        return ForcedDraftSource(m, ModelDraftSource(draft, opts, rng)), -1.0
    hybrid = HybridDraftSource(LookupDraftSource(), ModelDraftSource(draft, opts, rng))
    return ForcedDraftSource(m, hybrid), -1.0


def run_one(
    method: str, target: nn.Module, draft: nn.Module, tokenizer: Any, prompt: list[int],
    schema: dict[str, Any], opts: SamplingOptions, limit: int, costs: Costs, max_k: int | None,
    history: SpecHistory, vocab: int, eos: set[int],
) -> tuple[list[int], Generation, Matcher | None, float, float]:  # fmt: skip
    m = None
    if method != "plain":
        m = Matcher.build(GrammarSpec.schema(schema), tokenizer, vocab, sorted(eos))
    rng = Rng(opts.seed)
    source, cost = source_for(method, m, draft, opts, rng)
    controller = None
    if source is not None:
        draft_cost = costs.draft_step if cost < 0 else 0.0
        cap = draft_cap(max_k, None, free=draft_cost == 0)  # as the server caps it
        controller = DraftLengthController(
            costs, cap, draft_cost, history=history, source=source.name, regime=opts.regime,
            free_k=draft_cap(max_k, None, free=True),
        )  # fmt: skip
    stops = eos if m is not None else set()  # unconstrained: exactly `limit` tokens
    gen = Generation(target, prompt, opts, stops, limit, rng, source, controller, grammar=m)
    try:
        gen.prefill()
        t0, h0 = time.perf_counter(), time.thread_time()
        out = [t for new in gen for t in new]
        return out, gen, m, time.perf_counter() - t0, time.thread_time() - h0
    finally:
        gen.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pair", type=Path, default=Path("/work/shared/models/code-pair"))
    ap.add_argument("--tokens", type=int, default=160, help="the most new tokens per request")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--schemas", type=int, default=len(SCHEMAS))
    ap.add_argument(
        "--max-k", type=int, default=None, help="draft_num_predict (default: the server's)"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="the random-weight test models instead")
    ap.add_argument("--methods", default=",".join(METHODS), help="a subset, in this order")
    args = ap.parse_args()
    methods = [m for m in METHODS if m in args.methods.split(",")]
    if "plain" in methods and "grammar" not in methods:
        ap.error("plain decodes as many tokens as grammar alone: keep grammar in --methods")

    pair = args.pair
    if args.tiny:
        from tests.fixtures.tiny_models import build_pair

        pair = build_pair(Path(tempfile.mkdtemp(prefix="mlxd-bench-"))).root
    target, tokenizer, config = load_model(pair / "target", BACKEND)
    draft = load_model(pair / "draft", BACKEND)[0]
    vocab = logits_width(config, tokenizer)
    eos = set(tokenizer.eos_token_ids)
    costs = measure_costs(target, draft)
    warm_up(target, draft, costs, args.max_k)
    work = SCHEMAS[: args.schemas]
    prompts = []
    for what, text, schema in work:
        ask = f"Extract the {what} from this text as JSON matching {json.dumps(schema)}:\n{text}"
        prompts.append(
            list(tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": ask}])))
        )
    for prompt in prompts:  # every prompt's shapes seen once, untimed: the first method on a
        warm_prompt(target, draft, prompt)  # prompt would otherwise pay them for all the rest
    print(f"device: {mx.default_device()}  schemas: {len(work)}  max new tokens: {args.tokens}"
          f"  plain decoding: {costs.plain * 1e3:.2f} ms/token")  # fmt: skip
    # Compile every grammar once first (as a server does the first time it sees a schema):
    # reported on its own, not charged to whichever method happens to run first.
    t0 = time.perf_counter()
    Matcher.build(GrammarSpec("json"), tokenizer, vocab, sorted(eos))
    t1 = time.perf_counter()
    for _, _, schema in work:
        first = Matcher.build(GrammarSpec.schema(schema), tokenizer, vocab, sorted(eos))
        first.mask_into(first.bits()[0])  # the first mask builds the lexer's shared state
    t2 = time.perf_counter()
    print(f"llguidance tokenizer: {(t1 - t0) * 1e3:.0f} ms once per model;"
          f" compiling a schema and its first mask: {(t2 - t1) / len(work) * 1e3:.1f} ms the first time it is seen")  # fmt: skip
    temps = [float(t) for t in args.temps.split(",")]
    table = {(t, m): Row(m, t) for t in temps for m in methods}
    history = SpecHistory()
    for temp in temps:
        mismatches = 0
        # each method once, untimed, at this temperature: the kernels its sampling compiles
        # are a server's first request's cost, not its decoding rate
        warm = parse_options({"temperature": temp, "top_k": 0, "top_p": 1.0, "seed": 0})
        for method in methods:
            run_one(
                method, target, draft, tokenizer, prompts[0], work[0][2], warm, 24,
                costs, args.max_k, SpecHistory(), vocab, eos,
            )  # fmt: skip
        for i, (prompt, (_, _, schema)) in enumerate(zip(prompts, work, strict=True)):
            opts = parse_options({"temperature": temp, "top_k": 0, "top_p": 1.0, "seed": i})
            alone: list[int] = []
            for method in methods:  # methods take turns on each prompt: a slow spell hits all
                row = table[temp, method]
                limit = max(len(alone), 1) if method == "plain" else args.tokens
                t0 = time.perf_counter()
                out, gen, m, decoding, host = run_one(
                    method, target, draft, tokenizer, prompt, schema, opts, limit,
                    costs, args.max_k, history, vocab, eos,
                )  # fmt: skip
                row.seconds += time.perf_counter() - t0
                row.decode_seconds += decoding
                row.host_seconds += host
                row.tokens += len(out)
                row.requests += 1
                row.drafted += gen.stats.drafted
                row.accepted += gen.stats.accepted
                if m is not None:
                    row.masks += m.masks_computed
                    row.mask_seconds += m.mask_seconds
                    row.bias_seconds += getattr(m, "bias_seconds", 0.0)
                    row.forced += getattr(m, "masks_forced", 0)
                    row.valid += int(gen.finish == "stop" and valid_json(tokenizer, out))
                if method == "grammar":
                    alone = out
                elif m is not None and temp == 0 and out != alone:
                    mismatches += 1
        report([table[temp, m] for m in methods], temp, costs, mismatches)
        print(f"temperature {temp} done", flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"rate": r.rate} for r in table.values()]))


def warm_prompt(target: nn.Module, draft: nn.Module, prompt: list[int]) -> None:
    """Prefill `prompt` on both models and decode a few tokens, untimed."""
    gen = Generation(target, prompt, parse_options({"temperature": 0}), set(), 3, Rng(0))
    gen.prefill()
    for _ in gen:
        pass
    gen.close()
    cache = make_cache(draft)
    feed(draft, cache, prompt)
    mx.eval([c.state for c in cache])


def valid_json(tokenizer: Any, out: list[int]) -> bool:
    try:
        json.loads(tokenizer.decode([t for t in out if t not in tokenizer.eos_token_ids]))
        return True
    except ValueError:
        return False


def report(rows: list[Row], temp: float, costs: Costs, mismatches: int) -> None:
    """One table, plain first; the mask and bias shares are against the measured plain decode
    step (`costs.plain`)."""
    by = {r.method: r for r in rows}
    rows = [by[m] for m in ("plain", "grammar") if m in by] + [
        r for r in rows if r.method not in ("plain", "grammar")
    ]
    plain = by.get("plain")
    alone = by.get("grammar")
    step = costs.plain
    print(f"\ntemperature {temp}   (plain decode step {step * 1e3:.3f} ms)")
    head = f"{'method':<16}{'tok/s':>8}{'decode':>9}{'vs plain':>10}{'vs grammar':>12}{'host ms/tok':>13}"
    print(
        head + f"{'accept':>8}{'mask ms/tok':>13}{'bias ms/tok':>13}{'mask/step':>11}"
        f"{'forced':>8}{'complete':>10}"
    )

    def ratio(r: Row, base: Row | None) -> str:
        return f"{r.decode_rate / base.decode_rate:.2f}x" if base and base.decode_rate else "-"

    for r in rows:
        acc = f"{r.accepted / r.drafted:.2f}" if r.drafted else "-"
        mask_ms = r.mask_seconds / r.tokens * 1e3 if r.tokens and r.masks else 0.0
        bias_ms = r.bias_seconds / r.tokens * 1e3 if r.tokens and r.masks else 0.0
        share = f"{mask_ms / 1e3 / step:.1%}" if r.masks else "-"
        forced = f"{r.forced / r.masks:.0%}" if r.masks else "-"
        done = f"{r.valid}/{r.requests}" if r.masks else "-"
        print(
            f"{r.method:<16}{r.rate:>8.1f}{r.decode_rate:>9.1f}{ratio(r, plain):>10}"
            f"{ratio(r, alone):>12}{r.host_seconds / max(r.tokens, 1) * 1e3:>13.3f}{acc:>8}{mask_ms:>13.3f}{bias_ms:>13.3f}{share:>11}"
            f"{forced:>8}{done:>10}"
        )
    print(
        "(vs plain and vs grammar compare decode rates: prefill and setup left out; host ms/tok:"
        " the decoding thread's own CPU time, what a fast device waits for when the host is behind)"
    )
    if plain is not None and alone is not None:
        print(
            f"grammar alone / plain: {alone.decode_rate / plain.decode_rate:.2f}x decoding,"
            f" {alone.rate / plain.rate:.2f}x end to end"
        )
    spec = [r for r in rows if r.method.startswith("grammar+")]
    if alone is not None and spec:
        best = max(spec, key=lambda r: r.rate)
        floor = min(spec, key=lambda r: r.rate)
        print(
            f"best grammar x spec ({best.method}) / grammar alone: {best.rate / alone.rate:.2f}x"
            f"   slowest ({floor.method}): {floor.rate / alone.rate:.2f}x  (end to end)"
        )
    if temp == 0 and spec:
        print(f"token identity with grammar alone: {'yes' if not mismatches else 'NO'}"
              f" ({mismatches} mismatching outputs)")  # fmt: skip


if __name__ == "__main__":
    main()
