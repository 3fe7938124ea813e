"""A pairing served in one process vs its target sharded over N processes, same server, same run.

    python bench/distributed.py [--pair DIR] [--ranks 2] [--backend ring] [--strategy tensor]
                                [--clients 1,4] [--tokens 64] [--requests 2] [--rounds 2]

Serves the pair (default: the code pair, `target/` + `draft/`) twice from one `mlxd serve`:
`one` in the daemon's process, `sharded` with its target split over `--ranks` processes on
this machine (loopback hosts) through `mlx.launch` and `--backend` (ring on a CPU; `nccl` on a
multi-GPU host). For each client count it alternates bursts on the two, `--rounds` times, where
every client sends `--requests` greedy `/api/generate` requests, and prints aggregate tokens/s
of each and their ratio, with and without the draft model. On one small machine the ranks
share its cores and talk over loopback: the ratio there says what the per-forward round trip
costs, not what a model too big for one machine gains.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import free_port, released_at_once, wait_up

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"def function_{i}(values, threshold={i}):\n" for i in range(16)]


def one(pool: httpx.Client, base: str, model: str, prompt: str, tokens: int, method: str) -> int:
    body = {
        "model": model, "prompt": prompt, "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": tokens, "draft_method": method},
    }  # fmt: skip
    r = pool.post(f"{base}/api/generate", json=body)
    r.raise_for_status()
    return int(r.json()["eval_count"])


def burst(base: str, model: str, clients: int, requests: int, tokens: int, method: str) -> float:
    """Aggregate tokens/s: each client sends `requests` in a row."""

    def client(pool: httpx.Client, i: int) -> int:
        return sum(
            one(pool, base, model, PROMPTS[(i + j) % len(PROMPTS)], tokens, method)
            for j in range(requests)
        )

    results, wall = released_at_once(clients, client)
    return sum(results) / wall


def registry(pair: Path, ranks: int, backend: str, strategy: str, out: Path) -> Path:
    hosts = ", ".join(["127.0.0.1"] * ranks)
    target, draft = (pair / "target").resolve(), (pair / "draft").resolve()
    out.write_text(
        "models:\n"
        f"  one:\n    target: {target}\n    draft: {draft}\n"
        f"  sharded:\n    target: {target}\n    draft: {draft}\n"
        f"    distributed:\n      hosts: [{hosts}]\n      backend: {backend}\n"
        f"      strategy: {strategy}\n",
        encoding="utf-8",
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pair", type=Path, default=Path("/work/shared/models/code-pair"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", default="ring", choices=("ring", "jaccl", "nccl", "auto"))
    ap.add_argument("--strategy", default="tensor", choices=("tensor", "pipeline"))
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per burst")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default="off,model", help="draft methods to measure")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mlxd-bench-distributed-"))
    reg = registry(args.pair, args.ranks, args.backend, args.strategy, work / "models.yaml")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXD_HOME": str(work / "home"),
           "MLXD_HOST": f"127.0.0.1:{port}", "MLXD_CACHE_SSD": "0", "MLXD_NUM_PARALLEL": "4", "MLXD_KEEP_ALIVE": "-1"}  # fmt: skip
    cmd = [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(reg)]
    log = open(work / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(base, proc)
        with httpx.Client(timeout=900) as pool:
            for model in ("one", "sharded"):  # loaded (and its probe done) before measuring
                one(pool, base, model, PROMPTS[0], 8, "off")
        print(f"\npair {args.pair}  ranks {args.ranks}  backend {args.backend}"
              f"  strategy {args.strategy}  tokens {args.tokens}")  # fmt: skip
        print(
            f"{'draft':>6} {'clients':>7} {'1 process':>10} {f'{args.ranks} procs':>10} {'ratio':>6}"
        )
        for method in args.methods.split(","):
            for clients in [int(c) for c in args.clients.split(",")]:
                single, sharded = [], []
                for _ in range(args.rounds):
                    single.append(burst(base, "one", clients, args.requests, args.tokens, method))
                    sharded.append(
                        burst(base, "sharded", clients, args.requests, args.tokens, method)
                    )
                s, d = statistics.median(single), statistics.median(sharded)
                print(f"{method:>6} {clients:>7} {s:>10.1f} {d:>10.1f} {d / s:>6.2f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
        print(f"(server log: {work / 'serve.log'})")


if __name__ == "__main__":
    main()
