"""Opening a target/draft pairing with mlx-lm and measuring what speculation costs on it."""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load as mlx_load

from mlxd.engine import branches, dequant, fewrows, rowpad
from mlxd.engine.adapters import DEFAULT_ADAPTER_BYTES, AdapterSet
from mlxd.engine.backend import Backend
from mlxd.engine.context import row_context
from mlxd.engine.drafting import DraftSource, LookupDraftSource, ModelDraftSource, confidence
from mlxd.engine.fusedproj import fuse_gate_up
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import batch_type, make_cache, plain_kv, set_bucket
from mlxd.engine.kvquant import KvLayout, kv_layout
from mlxd.engine.memory import computes_in_float32
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.prefill import CHUNK, bucketed, feed, warm_shapes
from mlxd.engine.prompt import FimFormat, detect_fim
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import Costs, FixedDraftLength, SpecHistory
from mlxd.engine.textstream import TokenBytes, token_bytes
from mlxd.engine.truncation import MAX_CHARS_PER_TOKEN
from mlxd.registry.schema import ModelEntry
from mlxd.registry.store import model_digest, resolve_local
from mlxd.registry.templates import loaded_template

log = logging.getLogger(__name__)
VERIFY_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)
# token counts of a batch's verify rounds (rows x width, up to 8 x 16), measured as one row's
# forward: the cost model priced them from v(16) as if every token past it cost what the
# 16th did, so on a GPU, where a 64-token forward costs about what a 16-token one does, a
# batch of 4 rows never verified more than 4 drafts a row
WIDE_WIDTHS = (24, 32, 48, 64, 96, 128)
DRAFT_ROWS = (1, 2, 4, 8)  # rows of a batched draft step measured at probe-open
TARGET_ROWS = (1, 2, 3, 4, 5, 6, 7, 8)  # rows of a batched decode round measured at probe-open
GREEDY = parse_options({"temperature": 0})
# sampling forms each compile their own kernels (`sampling.sampler`): greedy, Ollama's defaults,
# top-p off (as OpenAI clients send), and the temperature alone
WARM_SAMPLING: tuple[dict[str, float], ...] = (
    {"temperature": 0.0},
    {"temperature": 0.7},
    {"temperature": 0.7, "top_p": 1.0},
    {"temperature": 0.7, "top_k": 0, "top_p": 1.0},
)
DEFAULT_DRAFT_TOKENS = 4  # the most drafts per round from a draft model (each costs a step)
# The most per round from sources that cost nothing to draft (prompt lookup, a grammar's forced
# tokens): the cost model then picks the length, and where a wide verify costs about what a
# narrow one does (a bf16 7B on an H200: 16 tokens 1.34 of one, 5 tokens 1.30) it verifies a
# long copied span in one round. 16 tokens is the widest lone verify the load measures
# (`VERIFY_WIDTHS`).
FREE_DRAFT_TOKENS = 15
WARM_DRAFT_TOKENS = 8  # the draft lengths whose rounds load runs by default (`warm_up`)


def draft_cap(requested: int | None, configured: int | None, free: bool) -> int:
    """The most drafts per round: the request's `draft_num_predict`, else the entry's
    `draft_tokens`, else the default of the source (`free`: it drafts at no cost)."""
    if requested is not None:
        return requested
    if configured is not None:
        return configured
    return FREE_DRAFT_TOKENS if free else DEFAULT_DRAFT_TOKENS


class ModelUnavailable(RuntimeError):
    """The pairing's files are missing or broken; the message says which and why."""


class ModelNotPulled(ModelUnavailable):
    """A model the pairing names has no files here yet (the API answers 404: pull it)."""


@dataclass
class Pairing:
    """A loaded target (and optional draft); owned by one runner thread."""

    entry: ModelEntry
    target: nn.Module
    tokenizer: Any
    draft: nn.Module | None
    target_dir: Path
    draft_dir: Path | None
    config: dict[str, Any]
    costs: Costs
    fim: FimFormat | None
    revision: str = ""  # the target's files and compute dtype: part of every prefix-cache namespace
    draft_revision: str = ""
    history: SpecHistory = field(default_factory=SpecHistory)  # what speculation did lately
    kv: KvLayout = field(default_factory=KvLayout)  # what quantizing its K/V depends on
    adapters: AdapterSet = field(init=False)  # mounted on the target, chosen per row
    draft_adapters: AdapterSet | None = field(init=False)  # mounted on the draft
    adapter_bytes: int = DEFAULT_ADAPTER_BYTES  # resident adapters' budget, per model
    adapter_histories: dict[str, SpecHistory] = field(default_factory=dict)

    def history_of(self, adapter: str) -> SpecHistory:
        """What speculation did lately for rows on `adapter` ("" the base): the draft drafts
        without the adapter, so how well it guesses is a matter of the adapter."""
        if not adapter:
            return self.history
        return self.adapter_histories.setdefault(adapter, SpecHistory())

    def __post_init__(self) -> None:
        self.adapters = AdapterSet(self.target, self.adapter_bytes)
        self.draft_adapters = (
            AdapterSet(self.draft, self.adapter_bytes) if self.draft is not None else None
        )

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @functools.cached_property
    def chars_per_token(self) -> int:
        """The longest token of the vocabulary, in characters (its written form: a byte-level
        token's text is never longer): how much text a prompt's tokens can span."""
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        return max((len(t) for t in vocab), default=MAX_CHARS_PER_TOKEN)

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        """Each token's own bytes (`engine.textstream.token_bytes`), for log-probabilities."""
        return token_bytes(self.tokenizer)

    @property
    def default_draft_tokens(self) -> int:
        """The most drafts per round from the draft model (the entry's or the default)."""
        return draft_cap(None, self.entry.draft_tokens, free=False)

    def row_context(self, opts: SamplingOptions) -> int:
        """Tokens a request's row may hold (`context.row_context`)."""
        return row_context(self.entry, self.config, opts)

    def check_options(self, opts: SamplingOptions) -> None:
        """Refuse options this model cannot take (OptionsError: 400): KV quantization groups
        must divide its K/V widths, and some caches cannot be quantized at all."""
        self.kv.check(opts.kv_bits, opts.kv_group_size)


def locate(ref: str, what: str) -> Path:
    path = resolve_local(ref)
    if path is None:
        raise ModelNotPulled(f"{what} '{ref}' is not available locally; pull it first")
    return path


def load_model(
    path: Path, backend: Backend, template: str | None = None
) -> tuple[nn.Module, Any, dict[str, Any]]:
    """A model as mlxd computes with it on `backend`: through mlx-lm, in float32 on the CPU
    where the backend widens its kind (16-bit or quantized: `computes_in_float32`), its MLPs'
    gate and up projections one matmul where it fuses them (`engine.fusedproj`), its few-token
    forwards' projections on mlxd's kernel where it takes them (`engine.fewrows`), with its
    caches laid out as the backend says."""
    tokenizer_config = {"chat_template": template} if template else None
    try:
        loaded = mlx_load(str(path), tokenizer_config=tokenizer_config, return_config=True)
        model, tokenizer, config = loaded  # type: ignore[misc]
    except Exception as exc:
        raise ModelUnavailable(f"cannot load {path}: {exc}") from exc
    if computes_in_float32(config, backend.float32_compute, backend.quantized_float32):
        model.set_dtype(mx.float32)
        if backend.float32_compute:  # an optimized BLAS: many rows multiply dequantized
            dequant.install(model)
    if backend.fused_mlp:
        fuse_gate_up(model)
    if backend.few_rows:
        fewrows.install(model, backend.few_rows_batches)
    set_bucket(model, backend.kv_bucket)
    return model, tokenizer, config


def revision_of(path: Path, config: dict[str, Any], backend: Backend) -> str:
    """The files' digest, and the dtype they compute in when that is not theirs: K/V computed
    in another dtype must never be restored from the prefix cache."""
    widened = computes_in_float32(config, backend.float32_compute, backend.quantized_float32)
    return model_digest(path) + ("+float32" if widened else "")


def _forward_seconds(
    model: nn.Module, widths: tuple[int, ...], context: int, passes: int = 7, keep: bool = True
) -> dict[int, float]:
    """Median seconds of an L-token forward at a cache length never seen before (as in real
    decoding, where every round lands on a new length). The widths take turns, pass after
    pass, so a slow spell of the machine skews none of the ratios between them; the first pass
    only warms up. Not `keep`: each forward's tokens are trimmed off again where the cache
    can be trimmed, so wide forwards do not carry the cache into buckets of keys no other
    width sees."""
    cache = make_cache(model)
    feed(model, cache, [0] * context)
    mx.eval([c.state for c in cache])
    samples: dict[int, list[float]] = {width: [] for width in widths}
    for i in range(passes + 1):
        for width in widths:
            x = mx.zeros((1, width), dtype=mx.uint32)
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache))
            if i:
                samples[width].append(time.perf_counter() - t0)
            if not keep and can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, width)
    return {width: statistics.median(s) for width, s in samples.items()}


def _rows_seconds(
    model: nn.Module, rows: tuple[int, ...], context: int, passes: int = 5
) -> dict[int, float]:
    """Median seconds of a B-row single-token forward over a batch cache of `context` keys
    per row: what one batched draft step (`engine.draftbatch`) or plain round costs."""
    kind = batch_type(model)
    caches = {}
    for b in rows:
        own = [make_cache(model) for _ in range(b)]
        for cache in own:
            feed(model, cache, [0] * context)
        caches[b] = [kind.merge([c[i] for c in own]) for i in range(len(own[0]))]
        mx.eval([c.state for c in caches[b]])
    samples: dict[int, list[float]] = {b: [] for b in rows}
    for i in range(passes + 1):
        for b in rows:
            x = mx.zeros((b, 1), dtype=mx.uint32)
            t0 = time.perf_counter()
            mx.eval(model(x, cache=caches[b]))
            if i:
                samples[b].append(time.perf_counter() - t0)
            for c in caches[b]:
                c.trim(1)  # the same key length every pass
    return {b: statistics.median(s) for b, s in samples.items()}


def _plain_seconds(target: nn.Module, context: int, tokens: int = 24) -> float:
    """Seconds per token of plain pipelined greedy decoding: the rate speculation must beat."""
    gen = Generation(target, [0] * context, GREEDY, set(), tokens, Rng(0))
    try:
        gen.prefill()
        stamps = [time.perf_counter() for _ in gen]
    finally:
        gen.close()
    return (stamps[-1] - stamps[3]) / (len(stamps) - 4)


def _recompute_rate(target: nn.Module, tokens: int = 512) -> float:
    """Bytes of K/V per second a cold prefill of `tokens` produces (the second of two runs):
    what restoring a prefix from a cache tier must beat to pay."""
    seconds, held = 0.0, 0
    for _ in range(2):
        cache = make_cache(target)
        t0 = time.perf_counter()
        feed(target, cache, [0] * tokens)
        mx.eval([c.state for c in cache])
        seconds = time.perf_counter() - t0
        held = sum(
            c.keys[..., :tokens, :].nbytes + c.values[..., :tokens, :].nbytes
            for c in cache
            if plain_kv(c) and c.keys is not None and c.values is not None
        )
    return held / seconds if seconds > 0 else 0.0


def measure_costs(
    target: nn.Module, draft: nn.Module | None, context: int = 64, sharded: bool = False
) -> Costs:
    """What speculation costs on this pairing. A `sharded` target is measured in fewer passes
    (each of its forwards is a round trip through its ranks), and its prefill rate is left
    unknown: its ranks decide about their own prefix caches' SSD tiers."""
    passes = 2 if sharded else 7
    verify = _forward_seconds(target, VERIFY_WIDTHS, context, passes)
    batched: dict[int, float] = {}
    if not sharded and all(plain_kv(c) for c in make_cache(target)):
        batched = _rows_seconds(target, TARGET_ROWS, context)
    padded = {} if sharded else rowpad.plan_both(verify, batched)
    if padded and rowpad.install(target, padded):  # what the padded widths cost now
        log.info("forwards of n tokens run as m (n: m): %s", padded)
        verify |= _forward_seconds(
            target, tuple(w for w in VERIFY_WIDTHS if w in padded), context, passes
        )
    # where shapes compile (a GPU) the curve flattens past 16 tokens; on a CPU it stays about
    # linear, so pricing from v(16) holds there (code pair: v(128) 32.0 measured against 37.8)
    # and measuring would add 14 s to its probe; a sharded forward this wide sends back only
    # its last logits
    if bucketed(target) and not sharded:
        verify |= _forward_seconds(target, WIDE_WIDTHS, context, 3, keep=False)
    draft_step = _forward_seconds(draft, (1,), context)[1] if draft is not None else 0.0
    rows = {}
    if draft is not None and all(plain_kv(c) for c in make_cache(draft)):
        rows = _rows_seconds(draft, DRAFT_ROWS, context)
    return Costs(
        verify=verify,
        draft_step=draft_step,
        draft_batch=rows,
        padded=padded,
        plain_step=_plain_seconds(target, context),
        recompute_rate=0.0 if sharded else _recompute_rate(target),
    )


def warm_up(
    target: nn.Module,
    draft: nn.Module | None,
    costs: Costs,
    max_k: int | None = None,
    context: int = CHUNK,
) -> None:
    """Run every round shape once (each k, greedy and sampled, each draft source), and every
    prompt chunk shape up to `context` tokens, so kernels are compiled at probe-open rather
    than inside a user's first requests. Where shapes compile (bucketed caches), prompt lookup
    runs every k up to `FREE_DRAFT_TOKENS` (its rounds reach that width), from a prompt whose
    repeated span it can continue that far."""
    for model in (target, draft):
        if model is not None:
            warm_shapes(model, context)
    widths = range(2, FREE_DRAFT_TOKENS + 2)
    if any(costs.branches(w, branches.MAX_BRANCHES) > 1 for w in widths):
        branches.branchable(target, make_cache(target))  # its one check of a grid forward
    max_k = WARM_DRAFT_TOKENS if max_k is None else max_k
    free_k = max(max_k, FREE_DRAFT_TOKENS) if bucketed(target) else max_k
    prompt = [0, 1, 2, 3] * 4
    copied = list(range(free_k + 1)) * 2
    for options in WARM_SAMPLING if bucketed(target) else WARM_SAMPLING[:2]:
        opts = parse_options({**options, "seed": 0})
        if draft is not None:  # a draft chain's read of its probabilities (`DraftGate`)
            logits = draft(mx.array([prompt]))[0, -1:, :]
            mx.eval(confidence(logits, mx.argmax(logits, axis=-1), [opts]))
        for k in range(1, free_k + 1):
            sources: list[tuple[DraftSource, list[int]]] = [(LookupDraftSource(4, 1), copied)]
            if draft is not None and k <= max_k:
                sources.append((ModelDraftSource(draft, opts, Rng(0)), prompt))
            for source, text in sources:
                rng = Rng(0)
                gen = Generation(
                    target, text, opts, set(), 2 * k + 2, rng, source, FixedDraftLength(costs, k)
                )
                try:
                    gen.prefill()
                    for _ in gen:
                        pass
                finally:
                    gen.close()


SHARDED_KV = KvLayout(refusal="a distributed target keeps its K/V unquantized")


def _load_sharded(
    entry: ModelEntry, path: Path, backend: Backend
) -> tuple[Any, Any, dict[str, Any]]:
    """A target sharded over the ranks the entry names (`engine.distributed`)."""
    from mlxd.engine.distributed.loading import GroupError, load_distributed

    assert entry.distributed is not None
    try:
        return load_distributed(
            entry.name, path, entry.distributed, backend, loaded_template(entry.template)
        )
    except (GroupError, OSError, ValueError) as exc:
        raise ModelUnavailable(f"cannot start the distributed target: {exc}") from exc


def close_target(target: Any) -> None:
    """Stop a distributed target's ranks now (a local model has nothing to stop)."""
    close = getattr(target, "close", None)
    if callable(close):
        close()


def check_tokenizers(target_tok: Any, draft_tok: Any) -> None:
    """Speculation compares token ids, so both sides must map the same strings to the same ids."""
    probes = ["def fib(n):\n    return n", "Hello, world! 123", " héllo ✓", "\n\n\t"]
    for text in probes:
        if list(target_tok.encode(text)) != list(draft_tok.encode(text)):
            raise ModelUnavailable("draft tokenizer differs from the target's")
    if set(target_tok.eos_token_ids) != set(draft_tok.eos_token_ids):
        raise ModelUnavailable("draft and target disagree on end-of-sequence tokens")


def load_pairing(
    entry: ModelEntry,
    backend: Backend,
    costs: Costs | None = None,
    adapter_bytes: int = DEFAULT_ADAPTER_BYTES,
) -> Pairing:
    """Open and check a pairing on `backend`. Without `costs` (from an earlier probe in this
    process) the forwards are measured and every round shape is run once, which also proves
    both models compute."""
    target_dir = locate(entry.target, "target")
    if entry.distributed is not None:
        target, tokenizer, config = _load_sharded(entry, target_dir, backend)
    else:
        target, tokenizer, config = load_model(target_dir, backend, loaded_template(entry.template))
    draft = None
    draft_dir = None
    draft_revision = ""
    if entry.draft:
        draft_dir = locate(entry.draft, "draft")
        draft, draft_tok, draft_config = load_model(draft_dir, backend)
        draft_revision = revision_of(draft_dir, draft_config, backend)
        check_tokenizers(tokenizer, draft_tok)
    try:
        kv = kv_layout(target) if entry.distributed is None else SHARDED_KV
        if costs is None:
            costs = measure_costs(target, draft, sharded=entry.distributed is not None)
            # proves every round shape computes; the serving thread warms the whole row
            # context for itself (MLX's CUDA build keeps compiled kernels per thread). A
            # sharded target's ranks compile on their own threads: measuring proved it computes.
            if entry.distributed is None:
                warm_up(target, draft, costs)
        elif entry.distributed is None:  # measured by an earlier probe: pad as it found
            rowpad.install(target, costs.padded)
    except Exception as exc:
        close_target(target)
        raise ModelUnavailable(f"a forward pass failed: {exc}") from exc
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    fim = detect_fim(vocab)
    if fim is not None and fim.end in vocab:  # a fill ends there (CodeLlama's <EOT>)
        tokenizer.add_eos_token(fim.end)
    return Pairing(
        entry=entry,
        target=target,
        tokenizer=tokenizer,
        draft=draft,
        target_dir=target_dir,
        draft_dir=draft_dir,
        config=config,
        costs=costs,
        fim=fim,
        revision=revision_of(target_dir, config, backend),
        draft_revision=draft_revision,
        kv=kv,
        adapter_bytes=adapter_bytes,
    )
