"""How a generation uses the prefix cache: which namespace, what to restore, what to offer."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mlxd.engine.drafting import DraftSource, HybridDraftSource, ModelDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import bucket_of
from mlxd.engine.options import SamplingOptions
from mlxd.engine.pairing import Pairing
from mlxd.engine.prefix_cache import Block, Namespace, PrefixCache, build_caches, slice_layers
from mlxd.engine.sampling import Rng

log = logging.getLogger(__name__)


def has_companion(source: DraftSource | None) -> bool:
    return isinstance(source, ModelDraftSource | HybridDraftSource)


def namespace_for(pairing: Pairing, opts: SamplingOptions, source: DraftSource | None) -> Namespace:
    """A draft method that stores a draft model's state beside the target's is its own
    namespace; without one (off, lookup, batch rows) the blocks are the same target K/V."""
    kv = f"{opts.kv_bits}/{opts.kv_group_size}/{opts.quantized_kv_start}" if opts.kv_bits else ""
    draft = "off"
    if source is not None and has_companion(source):
        draft = f"{source.name}:{pairing.draft_revision}"
    return Namespace(model=pairing.revision, kv=kv, draft=draft)


def restore(
    cache: PrefixCache,
    ns: Namespace,
    pairing: Pairing,
    prompt: Sequence[int],
    source: DraftSource | None,
) -> tuple[list[Any] | None, int]:
    """Target caches holding the longest cached prefix of the prompt (all but its last token),
    with the draft's companion state restored into `source`; (None, 0) on a miss."""
    blocks = cache.lookup(ns, prompt[:-1])
    if not blocks:
        return None, 0
    layers = len(pairing.target.layers)
    tokens = sum(b.tokens for b in blocks)
    try:
        target = build_caches(blocks, 0, layers, bucket_of(pairing.target))
        if has_companion(source) and pairing.draft is not None:
            assert source is not None
            end = layers + len(pairing.draft.layers)
            draft = build_caches(blocks, layers, end, bucket_of(pairing.draft))
            source.restore((draft, list(prompt[:tokens])))
    except (ValueError, IndexError) as exc:
        log.warning("prefix cache: unusable entry treated as a miss: %s", exc)
        return None, 0
    return target, tokens


def offer(cache: PrefixCache, ns: Namespace, gen: Generation, companion: bool) -> int:
    """Insert the full blocks of what a generation's caches really hold."""
    draft: tuple[list[Any], list[int]] | None = None
    if companion:
        state = gen.source.checkpoint() if gen.source is not None else None
        if not state or not state[0]:
            return 0  # the draft's state is gone (speculation stopped): keep the pair whole
        draft = state
    return offer_caches(cache, ns, gen.cache, gen.tokens, draft)


def offer_final(
    cache: PrefixCache,
    ns: Namespace,
    gen: Generation,
    pairing: Pairing,
    prompt_len: int,
    companion: bool,
) -> int:
    """Offer a finished solo generation: its prompt (all but the last token) and everything
    it holds. In a namespace with the draft's state beside the target's, the draft must
    cover what is offered, yet speculation that was paused may never have read the prompt
    (its prefill is deferred) or may have dropped the draft model (stepped down to prompt
    lookup, or fell back): the draft reads the tokens now, after the response, so the next
    identical prompt still hits."""
    if not companion:
        offered = offer_caches(cache, ns, gen.cache, gen.tokens[: prompt_len - 1])
        return offered + offer_caches(cache, ns, gen.cache, gen.tokens)
    fresh: ModelDraftSource | None = None
    try:
        if has_companion(gen.source):
            gen.ready_source()  # a paused draft reads the tokens now (may drop a failing one)
        source = gen.source if has_companion(gen.source) else None
        if source is None and pairing.draft is not None:
            source = fresh = ModelDraftSource(pairing.draft, gen.opts, Rng(0))
            fresh.prefill(gen.tokens)
        state = source.checkpoint() if source is not None else None
        if not state or not state[0]:
            return 0  # no draft state to store beside the target's: keep the pair whole
        offered = offer_caches(cache, ns, gen.cache, gen.tokens[: prompt_len - 1], state)
        return offered + offer_caches(cache, ns, gen.cache, gen.tokens, state)
    except Exception:  # the response is out already: the cache misses this one, no more
        log.exception("prefix cache: offering a finished request failed")
        return 0
    finally:
        if fresh is not None:
            fresh.dispose()


def offer_caches(
    cache: PrefixCache,
    ns: Namespace,
    target: list[Any],
    tokens: Sequence[int],
    draft: tuple[list[Any], list[int]] | None = None,
) -> int:
    """Insert the full blocks covered by `target` (and the draft's state, when given); the
    key is derived from what the caches hold (their offset), never from what was streamed."""
    if not target:
        return 0
    covered = min(int(target[0].offset), len(tokens))
    draft_cache: list[Any] = []
    if draft is not None:
        draft_cache, draft_tokens = draft
        covered = min(covered, len(draft_tokens))

    def sliced(start: int, end: int) -> Block | None:
        block = slice_layers(target, start, end)
        if block is None or draft is None:
            return block
        extra = slice_layers(draft_cache, start, end)
        return (
            None if extra is None else Block(block.kinds + extra.kinds, block.arrays + extra.arrays)
        )

    inserted = 0
    held = list(tokens[:covered])
    for index, key in cache.missing(ns, held):
        block = sliced(index * cache.block, (index + 1) * cache.block)
        if block is None:
            return inserted  # a cache kind the prefix cache cannot slice
        cache.insert(key, block)
        inserted += 1
    tail = cache.tail(ns, held)
    if tail is not None:
        start = covered // cache.block * cache.block
        block = sliced(start, covered)
        if block is not None:
            cache.insert_tail(tail[0], held[start:], tail[1], block)
            inserted += 1
    return inserted
