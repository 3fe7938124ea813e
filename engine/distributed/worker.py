"""One rank of a sharded target: load, shard, then replay what rank 0 broadcasts.

Started by `mlx.launch` (never by hand); rank 0 connects to the daemon's socket, reads each
message (a journal of cache operations, maybe ending in a forward), broadcasts it, and every
rank applies it to its own caches; rank 0 sends the forward's logits back. Any rank dying ends
the whole group (the launcher stops the others), which the daemon sees as its socket closing.

    python -m mlxd.engine.distributed.worker --socket PATH --model DIR --strategy tensor
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlx_lm.utils import load_model

from mlxd.engine.cache_use import offer_caches
from mlxd.engine.distributed import wire
from mlxd.engine.prefix_cache import Found, Namespace, PrefixCache, build_caches

LAST_ONLY = "last"
QUIT = "quit"


class Replica:
    """A rank's real caches, by the daemon's shadow ids; each id holds every layer of a list.

    With a prefix cache, each rank keeps its own shard's blocks under a namespace naming the
    split and the rank (`split`): a restore takes only as many blocks as EVERY rank holds
    (agreed through a collective), so the ranks' caches always stay the same length."""

    def __init__(
        self,
        model: nn.Module,
        group: mx.distributed.Group | None = None,
        prefix: PrefixCache | None = None,
        split: str = "",
    ) -> None:
        self.model = model
        self.group = group
        self.prefix = prefix
        self.split = split
        self.caches: dict[int, list[Any]] = {}

    def namespace(self, fields: tuple[str, str, str]) -> Namespace:
        model, adapter, kv = fields
        return Namespace(model=f"{model}|{self.split}", adapter=adapter, kv=kv)

    def offer(self, sid: int, tokens: list[int], fields: tuple[str, str, str]) -> int:
        if self.prefix is None:
            return 0
        return offer_caches(self.prefix, self.namespace(fields), self.caches[sid], tokens)

    def restore(self, sid: int, tokens: list[int], fields: tuple[str, str, str]) -> int:
        """Restore the prefix every rank holds into new caches `sid`; how many tokens."""
        found = Found()
        if self.prefix is not None:
            try:
                found = self.prefix.lookup_keyed(self.namespace(fields), tokens)
            except Exception:  # an unreadable entry is a miss on this rank
                found = Found()
        mine = mx.array([len(found)], dtype=mx.int32)
        agreed = len(found)
        if self.group is not None and self.group.size() > 1:
            every = mx.distributed.all_gather(mine, group=self.group)
            agreed = int(np.array(every).min())
        if agreed == 0:
            return 0
        blocks = [b for _, b in found[:agreed]]
        layers = len(make_prompt_cache(self.model))
        self.caches[sid] = build_caches(blocks, 0, layers, None)
        if self.prefix is not None:
            self.prefix.used(found.first(agreed))
        return int(self.caches[sid][0].offset)

    def apply(self, op: tuple[Any, ...]) -> Any:
        kind = op[0]
        if kind == "new":
            self.caches[op[1]] = make_prompt_cache(self.model)
        elif kind == "drop":
            self.caches.pop(op[1], None)
        elif kind == "merge":
            lists = [self.caches[i] for i in op[1]]
            self.caches[op[2]] = [
                BatchKVCache.merge([layers[n] for layers in lists]) for n in range(len(lists[0]))
            ]
        elif kind == "extract":
            self.caches[op[3]] = [c.extract(op[2]) for c in self.caches[op[1]]]
        elif kind == "extend":
            for mine, other in zip(self.caches[op[1]], self.caches[op[2]], strict=True):
                mine.extend(other)
        elif kind == "call":
            _, sid, name, args, kwargs = op
            if name == "filter":
                args = [mx.array(args[0])]
            for c in self.caches[sid]:
                getattr(c, name)(*args, **kwargs)
        elif kind == "forward":
            return self.forward(op[1], op[2], op[3])
        elif kind == "offer":
            return self.offer(op[1], op[2], op[3])
        elif kind == "restore":
            return self.restore(op[1], op[2], op[3])
        else:
            raise ValueError(f"unknown operation {kind!r}")
        return None

    def forward(self, sid: int, tokens: np.ndarray, keep: str) -> np.ndarray:
        cache = self.caches[sid]
        logits = self.model(mx.array(tokens), cache=cache)
        if keep == LAST_ONLY:
            logits = logits[:, -1:, :]
        logits = logits.astype(mx.float32)
        mx.eval(logits, [c.state for c in cache])
        return np.array(logits)


def load(model_dir: str, strategy: str, float32: bool, group: mx.distributed.Group) -> nn.Module:
    model, _ = load_model(Path(model_dir), lazy=True)
    if strategy == "pipeline":
        if not hasattr(getattr(model, "model", None), "pipeline"):
            raise ValueError(f"{type(model).__module__} cannot be split as a pipeline")
        model.model.pipeline(group)
    else:
        if not hasattr(model, "shard"):
            raise ValueError(f"{type(model).__module__} cannot be sharded as tensor parallel")
        model.shard(group)
    if float32:
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def serve(args: argparse.Namespace) -> int:
    backend = {"auto": "any"}.get(args.backend, args.backend)
    group = mx.distributed.init(backend=backend, strict=True)
    rank = group.rank()
    sock = None
    if rank == 0:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args.socket)
    error = ""
    model: nn.Module | None = None
    try:
        model = load(args.model, args.strategy, args.float32, group)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    ranks = wire.gather_text(f"{socket.gethostname()} pid {os.getpid()}", group)
    errors = wire.gather_text(error, group)
    if sock is not None:
        wire.send(sock, {"size": group.size(), "ranks": ranks, "errors": errors})
    if model is None or any(errors):
        return 1
    split = f"{args.strategy}x{group.size()}/rank{rank}"
    prefix = None
    if args.cache_ram > 0:
        ssd_dir = Path(args.cache_dir) / split if args.cache_dir else None
        prefix = PrefixCache(args.cache_ram, ssd_dir, args.cache_ssd if ssd_dir else 0)
    replica = Replica(model, group, prefix, split)
    while True:
        data = None
        if sock is not None:
            try:
                message = wire.receive(sock)
            except (wire.PeerGone, OSError):
                message = QUIT  # the daemon is gone: every rank ends
            data = pickle.dumps(message)
        message = pickle.loads(wire.broadcast(data, group))
        if message == QUIT:
            if prefix is not None:
                prefix.close()  # RAM-only blocks reach this rank's SSD tier
            return 0
        result: Any = None
        failure = None
        try:
            for op in message:
                result = replica.apply(op)
        except Exception as exc:
            failure = f"rank {rank}: {type(exc).__name__}: {exc}"
        if sock is not None:
            wire.send(sock, {"logits": result, "error": failure})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--strategy", default="tensor", choices=("tensor", "pipeline"))
    parser.add_argument("--backend", default="ring")
    parser.add_argument("--float32", action="store_true")
    parser.add_argument("--cache-ram", type=int, default=0, help="prefix cache RAM bytes")
    parser.add_argument("--cache-ssd", type=int, default=0, help="prefix cache SSD bytes")
    parser.add_argument("--cache-dir", default="", help="this split's SSD tier root")
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
