"""Concurrent streaming clients: mlxd vs `mlx_lm.server`, same model, same run.

    python bench/concurrency.py [--model DIR | --shape 8b] [--clients 1,2,4,8,16] [--tokens 128]
                                [--servers mlxd,mlx_lm.server] [--draft-method off]
    python bench/concurrency.py --pairing [DIR] [--clients 1,2,4,8] [--tokens 64] [--control]
                                [--methods auto,lookup] [--steady]

`--pairing` (default: the code pair; DIR: any folder with `target/` and `draft/`, such as a
pair fattened by shared/models/fatten.py) serves a target/draft pairing and compares, in one mlxd
run, batched speculation (`draft_method` auto, or each of `--methods`) with batched plain
decoding (`off`) at each client count, greedy and at temperature 0.7, through Ollama's
`/api/generate`: aggregate tokens/s of each, their ratio (and its range over the bursts), and
the drafts the final responses report accepted; then the daemon's slow rounds and its
speculation gate's comparisons of drafting and not, by row count (`engine/specgate.py`, as
logged). `--control` adds a second plain arm: on this repository's 2-core CPU two identical
arms read 0.92-1.11x of each other over 2 bursts a cell, wider than the floor. A burst is one
request per client, client i sending held-out prompt i, so a cell measures its first N prompts
and ends with its slowest: the rows that speculation speeds up finish first and the batch runs
out with fewer rows. `--steady` measures N clients that keep the server busy: each round sends
every held-out prompt, client i sending prompts i, i + N, ... back to back, so every cell reads
the same prompts and a short row's place goes to the client's next request.

Both servers are started by the bench on loopback ports and driven through the same OpenAI
`/v1/completions` streaming endpoint (temperature 0, fixed token count, no stop). For each
client count it prints aggregate tokens/s (all tokens / burst wall time), the median per-stream
decode rate and the median time to first token, then mlxd's ratios: aggregate at N clients vs
its own single stream, and vs mlx_lm.server at the same N. `--shape 8b` writes a random-weight
Llama with 8B-class shapes (bf16) beside the code-pair tokenizer first. mlxd serves the model
with its defaults (prompt lookup speculates on repetitive output); `--draft-method off` serves
it plainly, as mlx_lm.server and the in-process rows of `bench/rows.py` decode. Every burst
sends prompts no earlier one sent (distinct users: neither server's prompt cache helps), and
each burst of mlxd's lists the draft tokens its daemon proposed and accepted (`/metrics`);
each server reports the kernel modules MLX's CUDA build compiled after its model loaded (a
module compiled mid-stream stalls every row for seconds); `--cold-kernels` starts both from
an empty kernel cache, as on a machine's first start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192},
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def random_model(out: Path, tokenizer_dir: Path, shape: dict[str, int]) -> Path:
    """A random-weight Llama of the given shape, bf16, with `tokenizer_dir`'s tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": [2, 0], **shape,
    }  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    shard: dict[str, mx.array] = {}
    index: dict[str, str] = {}
    size, part = 0, 0

    def flush() -> None:
        nonlocal shard, size, part
        if shard:
            name = f"model-{part:05d}.safetensors"
            mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
            index.update(dict.fromkeys(shard, name))
            shard, size, part = {}, 0, part + 1

    for name, w in weights.items():
        shard[name] = w
        size += w.nbytes
        if size > 4 * 2**30:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )
    (out / "config.json").write_text(json.dumps(config))
    for f in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, out / f)
    return out


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited early: {proc.args}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server did not start: {proc.args}")


def stream_once(
    client: httpx.Client, base: str, model: str, prompt: str, tokens: int
) -> tuple[float, float, int]:
    """(time to first token, per-stream decode tok/s, tokens) for one streaming completion.
    Tokens are the server's own count (`usage`), not chunks: a random-weight model emits runs
    of byte-fragment tokens that a server holds back until their text is whole."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    stamps: list[float] = []
    counted = 0
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            counted = int((chunk.get("usage") or {}).get("completion_tokens") or counted)
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                stamps.append(time.perf_counter())
    if not stamps:
        return 0.0, 0.0, counted
    made = counted or len(stamps)
    rate = (made - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return stamps[0] - t0, rate, made


def released_at_once(
    clients: int, request: Callable[[httpx.Client, int], T]
) -> tuple[list[T], float]:
    """`request(pool, i)` for every client, all released at once; (results, wall seconds).
    Each client's connection pool is built before the clock starts: building one costs the
    bench's own GIL milliseconds per thread, which would otherwise stagger the burst and count
    against the server."""
    results: list[T] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    pools = [httpx.Client(timeout=900) for _ in range(clients)]

    def one(i: int) -> None:
        start.wait()
        r = request(pools[i], i)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        for pool in pools:
            pool.close()
    return results, wall


def burst(
    base: str, model: str | list[str], prompts: list[str], clients: int, tokens: int
) -> dict[str, float]:
    """One streaming completion per client, all released at once (several models: client i
    asks the i-th, in turn)."""
    models = [model] if isinstance(model, str) else model
    results, wall = released_at_once(
        clients,
        lambda pool, i: stream_once(
            pool, base, models[i % len(models)], prompts[i % len(prompts)], tokens
        ),
    )
    return {
        "aggregate": sum(r[2] for r in results) / wall,
        "per_stream": statistics.median(r[1] for r in results),
        "ttft": statistics.median(r[0] for r in results),
    }


FINAL_COUNTS = (
    "eval_count",
    "draft_count",
    "draft_accepted",
    "draft_filled",
    "draft_filled_accepted",
)


def generate_once(
    client: httpx.Client, base: str, model: str, prompt: str, options: dict[str, object]
) -> tuple[float, ...]:
    """(seconds, then each of `FINAL_COUNTS`) of one streamed `/api/generate`."""
    body = {"model": model, "prompt": prompt, "raw": True, "stream": True, "options": options}
    t0 = time.perf_counter()
    final: dict[str, int] = {}
    with client.stream("POST", f"{base}/api/generate", json=body) as r:
        for line in r.iter_lines():
            if line:
                chunk = json.loads(line)
                if chunk.get("done"):
                    final = chunk
    took = time.perf_counter() - t0
    return (took, *(int(final.get(key) or 0) for key in FINAL_COUNTS))


def pairing_burst(
    base: str, prompts: list[str], clients: int, options: dict[str, object], steady: bool = False
) -> dict[str, float]:
    """One request per client, all released at once (client i sends prompt i); `steady`:
    every prompt once, client i sending prompts i, i + clients, ... back to back."""

    def requests(pool: httpx.Client, i: int) -> list[tuple[float, ...]]:
        mine = prompts[i::clients] if steady else [prompts[i % len(prompts)]]
        return [generate_once(pool, base, "bench", p, options) for p in mine]

    sent, wall = released_at_once(clients, requests)
    results = [r for client in sent for r in client]
    return {
        "aggregate": sum(r[1] for r in results) / wall,
        "drafted": sum(r[2] for r in results),
        "accepted": sum(r[3] for r in results),
        "filled": sum(r[4] for r in results),
        "filled_accepted": sum(r[5] for r in results),
    }


def code_pair() -> Path:
    """The code pair beside this checkout (`<root>/../shared/models/code-pair`), or beside
    the folder that holds it (a checkout in a folder of worktrees)."""
    for up in (ROOT.parent, ROOT.parent.parent):
        pair = up / "shared/models/code-pair"
        if pair.is_dir():
            return pair
    return ROOT.parent / "shared/models/code-pair"


def pairing_main(
    pair: Path,
    counts: list[int],
    tokens: int,
    parallel: int,
    rounds: int,
    control: bool = False,
    methods: Sequence[str] = ("auto",),
    steady: bool = False,
) -> None:
    """Batched speculation (each of `methods`) vs batched plain decoding on one pairing, side by
    side. Each round's ratio is printed as a range too; `control` adds a second plain arm, whose
    ratio to the first says how far two identical arms drift apart on this machine; `steady`:
    each round sends every prompt, the clients sending theirs back to back (`pairing_burst`)."""
    missing = [d for d in ("target", "draft") if not (pair / d / "config.json").is_file()]
    if missing:
        raise SystemExit(f"{pair}: a pairing folder holds target/ and draft/ (no {missing})")
    # a fattened pair says what the code pair says: its held-out code prompts serve both
    found = [p / "heldout_prompts.json" for p in (pair, code_pair())]
    found = [f for f in found if f.is_file()]
    held = json.loads(found[0].read_text()) if found else {}
    prompts = [p["prompt"] for p in held.get("code", [])][:16] or [
        f"def function_{i}(values, threshold={i}):\n" for i in range(16)
    ]
    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    # runs on one machine share the pairing's probe (its costs, measured at load): a run after
    # the first starts in seconds; the probe's own key keeps a changed model or engine apart
    probes = Path(tempfile.gettempdir()) / "mlxd-bench-probes"
    probes.mkdir(exist_ok=True)
    (home / "probes").symlink_to(probes, target_is_directory=True)
    registry = home / "models.yaml"
    registry.write_text(
        f"models:\n  bench:\n    target: {(pair / 'target').resolve()}\n"
        f"    draft: {(pair / 'draft').resolve()}\n",
        encoding="utf-8",
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXD_HOME": str(home),
           "MLXD_HOST": f"127.0.0.1:{port}", "MLXD_NUM_PARALLEL": str(parallel)}  # fmt: skip
    cmd = [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry)]
    daemon_log = home / "daemon.log"  # its slow rounds are reported below
    with daemon_log.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    rows = []
    try:
        wait_up(f"{base}/api/tags", proc)
        # warm-up, reading every prompt the bursts send: else a cell's first burst reads the
        # prompts that the later ones find cached, and its arm (the first: speculation) pays
        for method in (*methods, "off"):
            warm = {"num_predict": 8, "draft_method": method}
            pairing_burst(base, prompts, max(counts), warm, steady=True)
        for temperature in (0.0, 0.7):
            for n in counts:
                zero = {"aggregate": 0.0, "drafted": 0.0, "accepted": 0.0, "filled": 0.0,
                        "filled_accepted": 0.0}  # fmt: skip
                specs = {m: dict(zero) for m in methods}
                plain, again = dict(zero), dict(zero)
                arms = [*specs.items(), ("off", plain)] + ([("off", again)] if control else [])
                per_round: dict[str, list[float]] = {m: [] for m in methods}
                # the arms alternate, so a slow spell hits every one, and every other round
                # runs them in reverse, so a drift within a round favours none
                for turn in range(rounds):
                    order = list(enumerate(arms))
                    if turn % 2:
                        order.reverse()
                    got: dict[int, float] = {}
                    for i, (method, into) in order:
                        opts = {"temperature": temperature, "num_predict": tokens,
                                "draft_method": method, "seed": 7}  # fmt: skip
                        r = pairing_burst(base, prompts, n, opts, steady)
                        if not r["aggregate"]:
                            raise SystemExit(f"mlxd streamed nothing ({method}, {n} clients)")
                        got[i] = r["aggregate"]
                        for key in into:
                            into[key] += r[key] / rounds
                    for i, m in enumerate(methods):
                        per_round[m].append(got[i] / got[len(methods)])
                for m, spec in specs.items():
                    rows.append((temperature, n, m, spec, plain, again, per_round[m]))
                print(f"T={temperature} {n} clients: {specs} plain {plain}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    logged = daemon_log.read_text(errors="replace").splitlines()
    slow = [line for line in logged if "slow round" in line]
    print(f"daemon rounds logged as slow: {len(slow)}")
    for line in slow[:20]:
        print("  " + line.split("slow round: ", 1)[-1])
    judged = [line for line in logged if "speculation gate: " in line]
    print(f"speculation gate's logged epochs (comparisons, stalls): {len(judged)}")
    for line in judged[:30]:
        print("  " + line.split("speculation gate: ", 1)[-1])
    load = f"steady ({len(prompts)} prompts a round)" if steady else "bursts"
    print(f"pairing {pair}  tokens per stream {tokens}  rounds {rounds}  load {load}")
    print(f"{'temp':>5} {'clients':>8} {'method':>7} | {'spec agg':>9} {'plain agg':>9} | "
          f"{'spec/plain':>10} {'by round':>12} | {'drafted':>8} {'accepted':>8} {'rate':>6} "
          f"{'filled':>7} {'taken':>6}"
          + (f" | {'plain/plain':>11}" if control else ""))  # fmt: skip
    for temperature, n, method, spec, plain, again, per_round in rows:
        rate = spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
        aa = f" | {ratio(again['aggregate'], plain['aggregate']):>11}" if control else ""
        print(
            f"{temperature:>5} {n:>8} {method:>7} | "
            f"{spec['aggregate']:>9.1f} {plain['aggregate']:>9.1f} | "
            f"{ratio(spec['aggregate'], plain['aggregate']):>10} {spread:>12} | "
            f"{spec['drafted']:>8.0f} {spec['accepted']:>8.0f} {rate:>6.2f} "
            f"{spec['filled']:>7.0f} {spec['filled_accepted']:>6.0f}{aa}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    pair = code_pair()
    ap.add_argument("--model", type=Path, default=pair / "target")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlxd-bench")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=16, help="MLXD_NUM_PARALLEL for mlxd")
    ap.add_argument(
        "--pairing",
        type=Path,
        nargs="?",
        const=pair,
        default=None,
        help="speculation vs plain decoding on a pairing folder with target/ and draft/ "
        "(default: the code pair; e.g. a fattened pair from shared/models/fatten.py)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="bursts per cell, averaged (--pairing)")
    ap.add_argument(
        "--steady", action="store_true",
        help="a round sends every prompt, each client its share back to back, not one request "
        "per client (--pairing)",
    )  # fmt: skip
    ap.add_argument(
        "--methods", default="auto",
        help="the speculating arms' draft_methods, each against off (--pairing): auto,model,lookup",
    )  # fmt: skip
    ap.add_argument(
        "--control", action="store_true",
        help="a second plain arm per cell (--pairing): how far identical arms drift apart",
    )  # fmt: skip
    ap.add_argument(
        "--servers", default="mlxd,mlx_lm.server", help="which servers to run (comma-separated)"
    )
    ap.add_argument(
        "--draft-method",
        choices=("auto", "model", "lookup", "off"),
        default=None,
        help="the mlxd entry's draft_method (default: the entry's own, auto); off decodes as "
        "mlx_lm.server does, without speculation",
    )
    ap.add_argument(
        "--cold-kernels", action="store_true",
        help="serve from an empty cache of MLX's compiled kernel modules (a GPU's first start)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.pairing is not None:
        counts = [int(c) for c in args.clients.split(",")]
        methods = args.methods.split(",")
        unknown = set(methods) - {"auto", "model", "lookup"}
        if unknown:
            ap.error(f"--methods takes auto, model and lookup (not {', '.join(sorted(unknown))})")
        pairing_main(
            args.pairing, counts, args.tokens, args.parallel, args.rounds, args.control,
            methods, args.steady,
        )  # fmt: skip
        return

    model = args.model
    if args.shape:
        model = random_model(args.workdir / f"random-{args.shape}", args.model, SHAPES[args.shape])
    counts = [int(c) for c in args.clients.split(",")]
    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    registry = home / "models.yaml"
    entry = f"models:\n  bench:\n    target: {model.resolve()}\n"
    if args.draft_method:
        entry += f'    options: {{draft_method: "{args.draft_method}"}}\n'
    registry.write_text(entry, encoding="utf-8")
    servers = [s for s in ("mlxd", "mlx_lm.server") if s in args.servers.split(",")]
    from mlxd.engine.backend import kernel_cache_dir

    kernels = kernel_cache_dir()  # where both servers keep MLX's compiled kernels
    if args.cold_kernels:  # as on a machine that never ran MLX's CUDA build
        kernels = Path(tempfile.mkdtemp(prefix="mlx-kernels-"))

    table: dict[str, dict[int, dict[str, float]]] = {}
    for name in servers:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if name == "mlxd":
            env.update(
                MLXD_HOME=str(home),
                MLXD_HOST=f"127.0.0.1:{port}",
                MLXD_NUM_PARALLEL=str(args.parallel),
            )
            cmd = [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry)]
            served = "bench"
        else:
            cmd = [
                sys.executable,
                "-m",
                "mlx_lm.server",
                "--model",
                str(model),
                "--port",
                str(port),
            ]
            served = str(model)
        env["MLX_PTX_CACHE_DIR"] = str(kernels)
        log = home / f"{name}.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_up(f"{base}/v1/models", proc)
            if name == "mlxd":  # an empty prompt loads the model (and warms it)
                httpx.post(f"{base}/api/generate", json={"model": served}, timeout=3600)
            loaded = modules(kernels)
            burst(base, served, fresh_prompts(0), 2, 16)  # warm-up
            table[name] = {}
            for i, n in enumerate(counts):  # by burst: a client count may be run again
                before = drafted(base) if name == "mlxd" else (0.0, 0.0)
                table[name][i] = r = burst(base, served, fresh_prompts(i + 1), n, args.tokens)
                if name == "mlxd":  # what speculation did in the burst (the daemon's metrics)
                    after = drafted(base)
                    r["drafted"], r["accepted"] = (
                        b - a for a, b in zip(before, after, strict=True)
                    )
                print(f"{name} {n} clients: {r}", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        compiled = sorted(modules(kernels) - loaded)
        print(f"{name}: kernel modules compiled after load: {len(compiled)}", *compiled,
              sep="\n  ")  # fmt: skip
        slow = [
            line for line in log.read_text(errors="replace").splitlines() if "slow round" in line
        ]
        if slow:
            print(f"{name} rounds logged as slow: {len(slow)}", *slow[:8], sep="\n  ")

    print(f"model {model}  tokens per stream {args.tokens}  mlxd draft_method "
          f"{args.draft_method or 'auto'}")  # fmt: skip
    print(
        f"{'clients':>8} | {'mlxd agg':>9} {'stream':>8} {'ttft ms':>8} | {'mlx_lm agg':>10} {'stream':>8} {'ttft ms':>8} | {'vs own 1':>8} {'vs mlx_lm':>9}"
    )
    none = {"aggregate": 0.0, "per_stream": 0.0, "ttft": 0.0}
    mine = table.get("mlxd", {})
    single = mine.get(0, none)["aggregate"]
    for i, n in enumerate(counts):
        a, b = mine.get(i, none), table.get("mlx_lm.server", {}).get(i, none)
        print(
            f"{n:>8} | {a['aggregate']:>9.1f} {a['per_stream']:>8.1f} {a['ttft'] * 1e3:>8.0f} | "
            f"{b['aggregate']:>10.1f} {b['per_stream']:>8.1f} {b['ttft'] * 1e3:>8.0f} | "
            f"{ratio(a['aggregate'], single):>8} {ratio(a['aggregate'], b['aggregate']):>9}"
        )


def drafted(base: str) -> tuple[float, float]:
    """mlxd's draft tokens proposed and accepted so far, summed over methods (`/metrics`)."""
    totals = {"mlxd_draft_tokens_proposed_total": 0.0, "mlxd_draft_tokens_accepted_total": 0.0}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["mlxd_draft_tokens_proposed_total"], totals["mlxd_draft_tokens_accepted_total"]


def modules(kernels: Path) -> set[str]:
    """The kernel modules MLX's CUDA build compiled into `kernels` (none on other backends)."""
    return {p.stem for p in kernels.glob("*.ptx")}


def fresh_prompts(burst: int) -> list[str]:
    """Sixteen code prompts no other burst sends: every request reads its prompt cold, as
    distinct users' requests do, on both servers (a burst resending earlier prompts finds
    them in mlxd's prefix cache and in mlx_lm.server's prompt cache)."""
    return [
        f"def function_{burst}_{i}(values, threshold={i}):\n"
        f'    """Return the values above the threshold."""\n'
        for i in range(16)
    ]


def ratio(ours: float, theirs: float) -> str:
    """`ours / theirs` as "1.23x"; "-" when the other side streamed nothing (a model that ends
    at once, a server that failed)."""
    return f"{ours / theirs:.2f}x" if theirs else "-"


if __name__ == "__main__":
    main()
