"""How a row uses the prefix cache: which namespace, what to restore, what to offer.

Target blocks are keyed by the target's namespace only, so every row on a target shares them,
solo or batched, whatever its draft method. A row with a draft model restores the draft's
attachments where the blocks have them and offers its own beside the blocks it stores.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mlxd.engine.drafting import DraftSource, HybridDraftSource, ModelDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import bucket_of
from mlxd.engine.options import SamplingOptions
from mlxd.engine.pairing import Pairing
from mlxd.engine.prefix_cache import (
    Block,
    Namespace,
    PrefixCache,
    build_caches,
    slice_layers,
    slice_run,
)

log = logging.getLogger(__name__)


def has_companion(source: DraftSource | None) -> bool:
    return isinstance(source, ModelDraftSource | HybridDraftSource)


def namespace_for(
    pairing: Pairing, opts: SamplingOptions, source: DraftSource | None = None, adapter: str = ""
) -> Namespace:
    """What decides the target's K/V: its revision (files and compute dtype), the adapter's
    revision (content digest and scale; "" on the base) and the KV quantization. The draft
    method is not part of it (the draft's state is an attachment)."""
    kv = f"{opts.kv_bits}/{opts.kv_group_size}/{opts.quantized_kv_start}" if opts.kv_bits else ""
    return Namespace(model=pairing.revision, adapter=adapter, kv=kv)


def restore(
    cache: PrefixCache,
    ns: Namespace,
    pairing: Pairing,
    prompt: Sequence[int],
    source: DraftSource | None,
    draft_revision: str | None = None,
) -> tuple[list[Any] | None, int]:
    """Target caches holding the longest cached prefix of the prompt (all but its last token),
    with the draft's state restored into `source` as far as the blocks carry it; (None, 0) on
    a miss. A row that quantizes its K/V (`Namespace.kv`) takes only a hit of its whole head:
    a cold prompt is read at full precision and quantized after, so the rest of a prompt read
    against a quantized prefix would differ from it (see `offer_final`)."""
    remote = getattr(pairing.target, "restore_prefix", None)
    if remote is not None:  # a distributed target: the ranks restore what all of them hold
        return remote(ns, list(prompt[:-1]))
    rate = pairing.costs.recompute_rate
    found = cache.lookup_keyed(ns, prompt[:-1], rate)
    if not found:
        return None, 0
    layers = len(pairing.target.layers)
    tokens = sum(b.tokens for _, b in found)
    if ns.kv and tokens < len(prompt) - 1:
        return None, 0
    try:
        target = build_caches([b for _, b in found], 0, layers, bucket_of(pairing.target))
    except (ValueError, IndexError) as exc:
        log.warning("prefix cache: unusable entry treated as a miss: %s", exc)
        return None, 0
    cache.used(found)
    if has_companion(source) and pairing.draft is not None:
        assert source is not None
        revision = pairing.draft_revision if draft_revision is None else draft_revision
        extras = cache.attachments([k for k, _ in found], revision, rate)
        if extras:
            try:
                draft = build_caches(extras, 0, len(pairing.draft.layers), bucket_of(pairing.draft))
                covered = sum(b.tokens for b in extras)
                source.restore((draft, list(prompt[:covered])))
            except (ValueError, IndexError) as exc:  # the draft reads the prompt itself
                log.warning("prefix cache: unusable draft state ignored: %s", exc)
    return target, tokens


def offer_prompt(
    cache: PrefixCache,
    ns: Namespace,
    gen: Generation,
    prompt_len: int,
    draft_revision: str = "",
    recompute_rate: float = 0.0,
) -> int:
    """Insert the blocks of a row's prompt (all but its last token: positions that no later
    step rolls back), with its draft model's state (when it has one and `draft_revision`
    names it) attached. A failure is a cache miss, logged."""
    try:
        draft = _draft_state(gen, draft_revision)
        prompt = gen.tokens[: prompt_len - 1]
        return offer_caches(
            cache, ns, gen.cache, prompt, draft, draft_revision, recompute_rate=recompute_rate
        )
    except Exception:
        log.exception("prefix cache: offering a prompt failed")
        return 0


def offer_final(
    cache: PrefixCache,
    ns: Namespace,
    gen: Generation,
    prompt_len: int,
    draft_revision: str = "",
    catch_up: bool = True,
    recompute_rate: float = 0.0,
) -> int:
    """Offer a finished row, after its response: its prompt (all but the last token, so the
    same prompt again restores its partial last block) and everything it holds. Speculation
    that was paused may never have let the draft read the prompt (its prefill is deferred):
    the draft reads the tokens now, so the next identical prompt restores its state too. A
    row whose draft model is gone (stepped down, failed) offers the target's blocks alone;
    a later row's draft reads what has no attachment. Without `catch_up` (other rows are
    waiting on this thread) the draft reads nothing now and only what it holds is attached.
    Any failure here is a cache miss, logged, never an error after the response."""
    try:
        if catch_up and draft_revision and has_companion(gen.source):
            gen.ready_source()  # a paused draft reads the tokens now (may drop a failing one)
        draft = _draft_state(gen, draft_revision)
        prompt = gen.tokens[: prompt_len - 1]
        offered = 0
        # K/V decoded against a quantized cache are not what reading the same tokens as a
        # prompt computes: a quantizing row offers its prompt's blocks alone
        runs = (prompt,) if ns.kv else (prompt, gen.tokens)
        for tokens in runs:  # its caches are written no more: runs view them
            offered += offer_caches(
                cache, ns, gen.cache, tokens, draft, draft_revision,
                finished=True, recompute_rate=recompute_rate,
            )  # fmt: skip
        return offered
    except Exception:
        log.exception("prefix cache: offering a finished request failed")
        return 0


def _draft_state(gen: Generation, draft_revision: str) -> tuple[list[Any], list[int]] | None:
    """The draft model's (caches, tokens) to attach, when the row has one that holds any."""
    if not draft_revision or not has_companion(gen.source):
        return None
    assert gen.source is not None
    state = gen.source.checkpoint()
    return state if state and state[0] else None


def offer_caches(
    cache: PrefixCache,
    ns: Namespace,
    target: list[Any],
    tokens: Sequence[int],
    draft: tuple[list[Any], list[int]] | None = None,
    draft_revision: str = "",
    finished: bool = False,
    recompute_rate: float = 0.0,
) -> int:
    """Insert the blocks covered by `target` (and attach the draft's state where it covers
    them); keys derive from what the caches hold (their offset), never from what was
    streamed. The caches of a `finished` row are viewed, not copied (`slice_run`). Blocks
    are written through to the SSD only where reading them back would beat recomputing
    them at `recompute_rate` (`PrefixCache.ssd_pays`): elsewhere a write only costs the
    rows decoding beside it."""
    if not target:
        return 0
    remote = getattr(target[0], "offer_remote", None)
    if remote is not None:  # a distributed target: each rank stores its own shard
        return int(remote(ns, list(tokens)))
    covered = min(int(target[0].offset), len(tokens))
    draft_cache: list[Any] = []
    draft_covered = 0
    if draft is not None:
        draft_cache, draft_tokens = draft
        draft_covered = min(covered, len(draft_tokens), _offset(draft_cache))
    held = list(tokens[:covered])
    through = cache.ssd_pays(recompute_rate)
    inserted = 0
    keys = cache.block_keys(ns, held)
    size = cache.block
    for span in _spans(cache.missing(ns, held)):
        blocks = _slice_span(target, span, size, finished)
        if blocks is None:
            return inserted  # a cache kind the prefix cache cannot slice
        for (i, key), block in zip(span, blocks, strict=True):
            parent = keys[i - 1] if i else ns.seed.hex()
            cache.insert(key, block, through, under=(parent, held[i * size : (i + 1) * size]))
        inserted += len(span)
    tail = cache.tail_of(ns, held)
    start = covered // cache.block * cache.block
    if tail is not None and not cache.has(tail[1]):
        last = slice_layers(target, start, covered)
        if last is not None:
            cache.insert_tail(tail[0], held[start:], tail[1], last)
            inserted += 1
    if draft is None or not draft_revision:
        return inserted
    keys = cache.block_keys(ns, held[:draft_covered])
    bare = [(i, k) for i, k in enumerate(keys) if not cache.has_attachment(k, draft_revision)]
    for span in _spans(bare):
        extras = _slice_span(draft_cache, span, cache.block, finished)
        if extras is None:
            return inserted
        for (_, key), extra in zip(span, extras, strict=True):
            cache.attach(key, draft_revision, extra, through)
        inserted += len(span)
    if tail is not None and draft_covered == covered and covered > start:
        last_extra = slice_layers(draft_cache, start, covered)
        if last_extra is not None and not cache.has_attachment(tail[1], draft_revision):
            cache.attach(tail[1], draft_revision, last_extra)
            inserted += 1
    return inserted


def _spans(indexed: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """(block index, key) pairs cut into runs of consecutive indices."""
    spans: list[list[tuple[int, str]]] = []
    for item in indexed:
        if spans and spans[-1][-1][0] + 1 == item[0]:
            spans[-1].append(item)
        else:
            spans.append([item])
    return spans


def _slice_span(
    caches: list[Any], span: list[tuple[int, str]], block: int, finished: bool
) -> list[Block] | None:
    """The span's blocks, in one run (see `prefix_cache.Run`)."""
    return slice_run(caches, span[0][0] * block, (span[-1][0] + 1) * block, block, finished)


def _offset(caches: list[Any]) -> int:
    return int(caches[0].offset) if caches else 0
