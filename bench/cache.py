"""Prefix cache, end to end through the real daemon: time to first token cold, warm from RAM and
warm from SSD after a restart, restore bandwidth, and the hit rate of a chat replay.

    python bench/cache.py [--model ../shared/models/code-pair/target] [--sizes 512,2048,8192]
                          [--turns 10] [--long-model PATH] [--json out.json]

What one run does:

1. Serves `--model` (entry `bench`) from an in-process daemon (`daemon.server.build_state` +
   the real app under uvicorn, as `mlxd serve` does) with a fresh prefix-cache directory.
   Sizes that do not fit its context (the daemon answers 400 unless prompt < context, so a
   2048-token prompt does not fit the code-pair target) go to entry `long`: `--long-model`, or
   by default a random-weight Llama built here with `tests/fixtures/tiny_models.write_model`
   (the code-pair target's shape and tokenizer -- hidden 512, 8 heads, 4 KV heads, MLP 1280,
   bf16 -- with 16384 positions and `--long-layers` layers, default 4 so that a CPU run stays
   near 4 minutes; the target has 8).
2. Per size: a raw prompt of exactly that many tokens (held-out code, tagged so it is new to
   the cache) is sent twice with `stream: true`: cold, then warm from RAM. TTFT is the time from
   sending the request to the first NDJSON line, as a client in its own process sees it.
3. A chat replay: `--turns` turns, each the previous conversation + the reply + a new user
   message; hit rate = cached prompt tokens / prompt tokens over turns 2..N.
4. The daemon shuts down (which persists its RAM blocks), a second daemon opens the same cache
   directory with an empty RAM tier, and each prompt is sent once more: warm from SSD.

Every model is loaded by a short warm-up request before anything is timed. Requests decode
greedily with speculation off (`--draft-method`), so TTFT is prefill + one decode step.
Restore bandwidth is bytes restored / time in `PrefixCache.lookup_keyed` (for SSD hits that is the
read, checksum and decode of every block; assembling the caches is lazy and lands in prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # 8k prompts > model_max_length: fine

from mlxd.engine.backend import configure_backend  # noqa: E402

BACKEND = configure_backend()  # first, as `mlxd serve` does: the CPU BLAS goes under MLX

DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "code-pair" / "target"
LONG_SHAPE = {
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1280,
}
LONG_CONTEXT = 16384
MiB = 2**20


# -- an in-process daemon ----------------------------------------------------------------------


class Daemon:
    """`mlxd serve` in a thread of this process, with the prefix cache on `cache_dir`."""

    def __init__(self, registry: Path, cache_dir: Path, ram_bytes: int, ssd_bytes: int) -> None:
        import socket

        import uvicorn

        from mlxd.api.app import build_app
        from mlxd.daemon.config import Settings
        from mlxd.daemon.server import build_state

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        settings = Settings(
            "127.0.0.1", self.port, registry, 3600.0, 4,
            cache_ram_bytes=ram_bytes, cache_ssd_bytes=ssd_bytes, cache_dir=cache_dir,
        )  # fmt: skip
        self.state = build_state(settings, BACKEND)
        config = uvicorn.Config(
            build_app(self.state), host="127.0.0.1", port=self.port, log_level="warning",
            timeout_graceful_shutdown=30,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.lookups: list[tuple[int, float]] = []  # (bytes, seconds) of each prefix lookup
        self.client: Client  # started with the daemon
        prefix = self.state.manager.prefix
        assert prefix is not None
        self.prefix = prefix
        inner = prefix.lookup_keyed

        def timed_lookup(*args: Any) -> Any:
            t0 = time.perf_counter()
            found = inner(*args)
            self.lookups.append((sum(b.nbytes for _, b in found), time.perf_counter() - t0))
            return found

        prefix.lookup_keyed = timed_lookup  # type: ignore[method-assign]

    def __enter__(self) -> Daemon:
        self.client = Client()
        self.thread.start()
        deadline = time.monotonic() + 600
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("daemon did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(600)


# A user's client runs in its own process: one in this process would take the GIL from the
# daemon's threads and read each line late (2-3 ms after it was written, on an H200's host).
# It times the request itself and sends the raw lines back, parsed here, untimed.
CLIENT = r"""
import json, sys, time
import httpx
with httpx.Client(timeout=None) as client:
    for job in sys.stdin:
        job = json.loads(job)
        lines, first = [], None
        try:
            t0 = time.perf_counter()
            with client.stream("POST", job["url"], json=job["body"]) as r:
                if r.status_code != 200:
                    out = {"error": f"HTTP {r.status_code}: {r.read().decode()}"}
                else:
                    for line in r.iter_lines():
                        if line:
                            first = first or time.perf_counter()
                            lines.append(line)
                    done = time.perf_counter()
                    out = {"ttft": first and first - t0, "total": done - t0, "lines": lines}
        except Exception as exc:
            out = {"error": repr(exc)}
        print(json.dumps(out), flush=True)
"""


class Client:
    """The HTTP client process: one streamed request at a time, as JSON lines over pipes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def request(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """{"ttft", "total", "lines"} or {"error"}."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"url": url, "body": body}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the client process ended")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- requests ----------------------------------------------------------------------------------


@dataclass
class Timed:
    ttft: float  # seconds to the first NDJSON line
    total: float
    prompt_tokens: int
    cached_tokens: int
    prefill: float  # the server's prompt_eval_duration, seconds
    restored_bytes: int
    restore_seconds: float
    text: str
    final: dict[str, Any] = field(repr=False)


def stream(daemon: Daemon, path: str, body: dict[str, Any]) -> Timed:
    daemon.lookups.clear()
    got = daemon.client.request(daemon.url + path, {**body, "stream": True})
    if "error" in got:
        raise RuntimeError(f"{path}: {got['error']}")
    text: list[str] = []
    final: dict[str, Any] = {}
    for line in got["lines"]:
        obj = json.loads(line)
        if "error" in obj:
            raise RuntimeError(f"{path}: {obj['error']}")
        text.append(obj.get("response") or obj.get("message", {}).get("content", ""))
        if obj.get("done"):
            final = obj
    assert got["ttft"] is not None and final, "empty stream"
    return Timed(
        ttft=got["ttft"],
        total=got["total"],
        prompt_tokens=int(final["prompt_eval_count"]),
        cached_tokens=int(final.get("prompt_cache_tokens", 0)),
        prefill=final["prompt_eval_duration"] / 1e9,
        restored_bytes=sum(b for b, _ in daemon.lookups),
        restore_seconds=sum(s for _, s in daemon.lookups),
        text="".join(text),
        final=final,
    )


def generate(daemon: Daemon, model: str, prompt: str, opts: dict[str, Any]) -> Timed:
    return stream(daemon, "/api/generate", {"model": model, "prompt": prompt, "raw": True,
                                            "options": opts})  # fmt: skip


# -- prompts -----------------------------------------------------------------------------------


class Prompts:
    """Raw prompts of an exact token count, from held-out code when the model has it."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.rng = random.Random(seed)
        self.run = uuid.uuid4().hex[:8]  # never seen by a cache directory before
        heldout = model_dir.parent / "heldout_prompts.json"
        if heldout.is_file():
            data = json.loads(heldout.read_text(encoding="utf-8"))
            self.code = [c["prompt"] + c["reference"] for c in data["code"]]
            self.chat_users = [c["user"] for c in data["chat"]]
        else:
            self.code = [Path(__file__).read_text(encoding="utf-8")]
            self.chat_users = [f"Write a Python function number {i}." for i in range(12)]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def exact(self, n: int, tag: str) -> str:
        """Text that encodes to exactly `n` tokens (decode a cut, fix up the boundary)."""
        parts = [f"# {self.run} {tag}\n"]
        while len(self.encode("".join(parts))) < n + 64:
            parts.append(self.rng.choice(self.code) + "\n\n")
        ids = self.encode("".join(parts))
        cut = n
        for _ in range(64):
            text = self.tokenizer.decode(ids[:cut])
            got = len(self.encode(text))
            if got == n:
                return text
            cut += n - got
        raise RuntimeError(f"could not build a prompt of exactly {n} tokens")

    def system(self, tokens: int = 384) -> str:
        head = "You are a careful Python assistant. The user is working on this module:\n\n"
        return head + self.exact(tokens, "chat-system")


# -- the benchmark -----------------------------------------------------------------------------


@dataclass
class SizeRow:
    size: int
    model: str
    prompt_tokens: int = 0
    cold: Timed | None = None
    ram: Timed | None = None
    ssd: Timed | None = None

    def ratio(self, which: Timed | None) -> float | None:
        if which is None or self.cold is None or self.cold.ttft <= 0:
            return None
        return which.ttft / self.cold.ttft


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft: float


def context_of(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return int(config.get("max_position_embeddings") or 4096)


def build_long_model(out: Path, tokenizer_dir: Path, layers: int) -> Path:
    from tests.fixtures.tiny_models import write_model

    return write_model(
        out, tokenizer_dir, seed=1234, max_position_embeddings=LONG_CONTEXT, dtype="bfloat16",
        hidden_size=LONG_SHAPE["hidden_size"], num_layers=layers,
        num_heads=LONG_SHAPE["num_heads"], num_kv_heads=LONG_SHAPE["num_kv_heads"],
        intermediate_size=LONG_SHAPE["intermediate_size"],
    )  # fmt: skip


def chat_replay(daemon: Daemon, prompts: Prompts, turns: int, opts: dict[str, Any]) -> list[Turn]:
    messages: list[dict[str, str]] = [{"role": "system", "content": prompts.system()}]
    out: list[Turn] = []
    for i in range(turns):
        user = prompts.chat_users[i % len(prompts.chat_users)]
        messages.append({"role": "user", "content": f"{user} (step {i + 1})"})
        try:
            t = stream(daemon, "/api/chat", {"model": "bench", "messages": messages,
                                             "options": opts})  # fmt: skip
        except RuntimeError as exc:
            if "context length" not in str(exc):
                raise
            print(f"chat replay stopped at turn {i + 1}: the conversation outgrew the context")
            break
        out.append(Turn(t.prompt_tokens, t.cached_tokens, t.ttft))
        messages.append({"role": "assistant", "content": t.text})
    return out


def fmt_ms(t: Timed | None) -> str:
    return f"{t.ttft * 1e3:9.0f}" if t is not None else f"{'-':>9}"


def fmt_ratio(r: float | None) -> str:
    return f"{100 * r:7.1f}%" if r is not None else f"{'-':>8}"


def fmt_bw(t: Timed | None) -> str:
    if t is None or not t.restored_bytes or t.restore_seconds <= 0:
        return f"{'-':>9}"
    return f"{t.restored_bytes / t.restore_seconds / 1e9:9.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory")
    ap.add_argument("--sizes", default="512,2048,8192", help="prompt sizes in tokens")
    ap.add_argument("--turns", type=int, default=10, help="turns of the chat replay (0: skip)")
    ap.add_argument("--long-model", type=Path, default=None,
                    help="model for sizes beyond --model's context (default: build one)")  # fmt: skip
    ap.add_argument("--long-layers", type=int, default=LONG_SHAPE["num_layers"],
                    help="layers of the built long-context model")  # fmt: skip
    ap.add_argument("--reply-tokens", type=int, default=48, help="num_predict of chat replies")
    ap.add_argument("--draft-method", default="off", help="draft_method of every request")
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: a fresh temp dir")
    ap.add_argument("--ram", type=int, default=2 * 2**30, help="RAM tier bytes")
    ap.add_argument("--ssd", type=int, default=20 * 2**30, help="SSD tier bytes")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mlxd-bench-cache-"))
    os.environ.setdefault("MLXD_HOME", str(work / "home"))  # no user registry, own digests
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    logging.basicConfig(level=logging.WARNING)

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    model = args.model.resolve()
    context = context_of(model)
    registry = work / "models.yaml"
    # the model's whole context (a row's default is 4k): the sizes that fit it, and the chat
    # replay's growing conversation, which a shorter one would truncate (then it hits only
    # the kept head)
    entries = f"models:\n  bench:\n    target: {model}\n    options:\n      num_ctx: {context}\n"
    long_dir: Path | None = None
    if any(s >= context for s in sizes):
        if args.long_model is not None:
            long_dir = args.long_model.resolve()
        else:
            t0 = time.perf_counter()
            long_dir = build_long_model(work / "long", model, args.long_layers)
            print(f"built the random long-context model in {time.perf_counter() - t0:.1f}s")
        num_ctx = min(context_of(long_dir), max(sizes) + 64)
        entries += f"  long:\n    target: {long_dir}\n    options:\n      num_ctx: {num_ctx}\n"
    registry.write_text(entries, encoding="utf-8")
    cache_dir = args.cache_dir or work / "kvcache"
    opts = {"temperature": 0, "num_predict": 4, "draft_method": args.draft_method}
    chat_opts = {**opts, "num_predict": args.reply_tokens}

    prompts = Prompts(model, seed=0)
    rows: list[SizeRow] = []
    for size in sizes:
        name = "bench" if size < context else "long"
        if name == "long" and long_dir is not None and context_of(long_dir) <= size:
            raise SystemExit(f"no model with a context of {size} tokens")
        rows.append(SizeRow(size, name))
    texts = {row.size: prompts.exact(row.size, f"size-{row.size}") for row in rows}
    used = sorted({row.model for row in rows} | {"bench"})

    def warm_up(daemon: Daemon) -> None:
        for name in used:  # loads the model; the prompt is new to the cache and unrelated
            generate(daemon, name, prompts.exact(256, f"warm-up-{uuid.uuid4().hex}"), opts)

    t_start = time.perf_counter()
    turns: list[Turn] = []
    with Daemon(registry, cache_dir, args.ram, args.ssd) as a:
        warm_up(a)
        for row in rows:
            row.cold = generate(a, row.model, texts[row.size], opts)
            row.ram = generate(a, row.model, texts[row.size], opts)
            row.prompt_tokens = row.cold.prompt_tokens
            if row.ram.text != row.cold.text:
                print(f"warning: {row.size}: the warm answer differs from the cold one")
            print(f"  {row.size:>6} tokens: cold {row.cold.ttft:.2f}s, RAM {row.ram.ttft:.2f}s",
                  flush=True)  # fmt: skip
        if args.turns > 0:
            turns = chat_replay(a, prompts, args.turns, chat_opts)
        snap_a = a.prefix.snapshot()
    with Daemon(registry, cache_dir, args.ram, args.ssd) as b:
        warm_up(b)
        for row in rows:
            row.ssd = generate(b, row.model, texts[row.size], opts)
            assert row.cold is not None
            if row.ssd.text != row.cold.text:
                print(f"warning: {row.size}: the SSD-warm answer differs from the cold one")
            print(f"  {row.size:>6} tokens: SSD {row.ssd.ttft:.2f}s", flush=True)
        snap_b = b.prefix.snapshot()
    elapsed = time.perf_counter() - t_start

    # -- report --------------------------------------------------------------------------------
    print()
    print(f"model: {model} (context {context})" + (f"; long: {long_dir}" if long_dir else ""))
    print(f"cache: {cache_dir}; block {snap_a['block_tokens']} tokens; "
          f"draft_method {args.draft_method}; {elapsed:.0f}s")  # fmt: skip
    print()
    print("time to first token (ms), stream: true, first NDJSON line")
    head = (
        f"{'tokens':>7} {'model':>5} {'cold':>9} {'RAM':>9} {'SSD':>9} {'RAM/cold':>8} "
        f"{'SSD/cold':>8} {'hit RAM':>7} {'hit SSD':>7} {'RAM GB/s':>9} {'SSD GB/s':>9}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        print(
            f"{row.prompt_tokens:>7} {row.model:>5} {fmt_ms(row.cold)} {fmt_ms(row.ram)} "
            f"{fmt_ms(row.ssd)} {fmt_ratio(row.ratio(row.ram))} {fmt_ratio(row.ratio(row.ssd))} "
            f"{row.ram.cached_tokens if row.ram else 0:>7} "
            f"{row.ssd.cached_tokens if row.ssd else 0:>7} {fmt_bw(row.ram)} {fmt_bw(row.ssd)}"
        )
    ssd_bytes = sum(r.ssd.restored_bytes for r in rows if r.ssd)
    ssd_secs = sum(r.ssd.restore_seconds for r in rows if r.ssd)
    if ssd_secs > 0:
        print(f"SSD restore bandwidth over all sizes: {ssd_bytes / MiB:.1f} MiB in "
              f"{ssd_secs * 1e3:.0f} ms = {ssd_bytes / ssd_secs / 1e9:.2f} GB/s")  # fmt: skip

    hit_rate = None
    if turns:
        print()
        print(f"chat replay: {len(turns)} turns, replies of {args.reply_tokens} tokens")
        print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'hit':>6} {'TTFT ms':>8}")
        for i, t in enumerate(turns, 1):
            rate = t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0
            print(f"{i:>4} {t.prompt_tokens:>7} {t.cached_tokens:>7} {100 * rate:5.1f}% "
                  f"{t.ttft * 1e3:8.0f}")  # fmt: skip
        later = turns[1:]
        prompt_sum = sum(t.prompt_tokens for t in later)
        hit_rate = sum(t.cached_tokens for t in later) / prompt_sum if prompt_sum else 0.0
        print(f"token-weighted hit rate, turns 2..{len(turns)}: {100 * hit_rate:.1f}%")

    print()
    print("goals")
    checks: list[tuple[str, bool]] = []
    for r in rows:
        ram_r, ssd_r = r.ratio(r.ram), r.ratio(r.ssd)
        if ram_r is not None and r.size >= 7000:
            checks.append((f"RAM-warm/cold at {r.prompt_tokens} tokens {100 * ram_r:.1f}% <= 10%",
                           ram_r <= 0.10))  # fmt: skip
        if ssd_r is not None:  # the SSD is read only where it beats recomputing
            checks.append((f"SSD-warm/cold at {r.prompt_tokens} tokens {100 * ssd_r:.1f}% <= 100%",
                           ssd_r <= 1.0))  # fmt: skip
    if hit_rate is not None:
        checks.append((f"chat hit rate turns 2+ {100 * hit_rate:.1f}% >= 90%", hit_rate >= 0.90))
    for text, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {text}")
    print(
        f"cache after run A: {snap_a['ram_blocks']} RAM blocks, "
        f"{snap_a['ssd_dropped_writes']} SSD writes dropped; run B: "
        f"{snap_b['ssd_hit_blocks']} SSD-hit blocks, {snap_b['ram_hit_blocks']} RAM-hit blocks"
    )
    print(
        f"SSD read rate measured {snap_b['ssd_read_rate'] / 1e9:.2f} GB/s; lookups that "
        f"recomputed rather than read the SSD: {snap_b['ssd_skipped_lookups']}"
    )

    if args.json is not None:
        data = {
            "model": str(model),
            "long_model": str(long_dir) if long_dir else None,
            "sizes": [
                {
                    "size": r.size,
                    "model": r.model,
                    **{
                        k: {kk: vv for kk, vv in asdict(v).items() if kk != "final"}
                        for k, v in (("cold", r.cold), ("ram", r.ram), ("ssd", r.ssd))
                        if v is not None
                    },
                }
                for r in rows
            ],
            "turns": [asdict(t) for t in turns],
            "hit_rate": hit_rate,
            "snapshots": {"a": snap_a, "b": snap_b},
        }
        args.json.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
