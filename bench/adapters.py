"""Four LoRA adapters on one base vs the base alone, same server, same run.

    python bench/adapters.py [--model DIR] [--clients 1,8] [--tokens 64] [--requests 4]
                             [--layers 16] [--profile DIR]

Trains four real adapters (mlx-lm's tuner, a few steps each) on `--model` (default: the code
pair's target) as `mlx_lm.lora` trains them by default: rank 8, scale 20, every projection of
the last `--layers` blocks (16; -1: every block, the costliest case). Serves the base and the
four adapter entries from one `mlxd serve`, and for each client count runs, alternately and
`--rounds` times, bursts where every client sends `--requests` greedy `/api/generate` requests
either all to the base or rotating over the four adapters (so rows of different adapters share
every batch). Each client count's first burst of each arm is run before those and printed
apart ("first"): what a new batch shape costs once (on MLX's CUDA build, traces and kernels a
row count has not run) stays out of the ratio and still shows; those bursts also read the
prompts that later bursts find in the prefix cache. Prints the steady bursts'
aggregate tokens/s of each, their ratio (goal >= 0.9), the base loads counted by `/metrics`
(goal: 1, i.e. zero reloads), and resident memory: the server's RSS and the bytes of its MLX
arrays (the RAM cache tier left out) with only the base loaded, after the adapters are
mounted and after every burst, and the adapters' own bytes (`mlxd_adapter_bytes`).
Speculation is off for both, so the ratio is what the per-row LoRA terms cost. It then prints
the server's own split of a request (from each response's durations): decode time per token,
prompt time, and the rest (queueing, admission, mounting). `--profile DIR` records the server
with py-spy (on PATH) during every burst, one file of collapsed stacks per burst.

On a machine whose cores other work shares, wall-clock throughput swings with that work; the
bench also prints tokens per CPU-second of the server process (Linux: from /proc), which
counts only the server's own work, and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import free_port, released_at_once, wait_up

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "SELECT name, email FROM users WHERE active = 1 ORDER BY name;\n" * 3,
    "def test_add():\n    assert add(1, 2) == 3\n    assert add(-1, 1) == 0\n" * 2,
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 2,
    "for i in range(10):\n    print(i * i, end=' ')\nprint()\n" * 3,
]
PROMPTS = [f"def function_{i}(values, threshold={i}):\n" for i in range(16)]
MODEL = ROOT.parent / "shared" / "models" / "code-pair" / "target"
WORKDIR = Path(tempfile.gettempdir()) / "mlxd-bench-adapters"  # the trained adapters, kept


def train(base: Path, out: Path, layers: int) -> list[Path]:
    from tests.fixtures.adapters import train_adapter

    paths = []
    for i, text in enumerate(TEXTS):
        target = out / f"adapter{i}-layers{layers}"
        if not (target / "adapters.safetensors").exists():
            t0 = time.perf_counter()
            train_adapter(
                base, target, text, rank=8, scale=20.0, num_layers=layers, steps=3, seed=i
            )
            print(f"trained adapter{i} in {time.perf_counter() - t0:.1f}s", flush=True)
        paths.append(target)
    return paths


def rss_bytes(pid: int) -> int:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) * 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process, all its threads (NaN where /proc is absent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return float("nan")
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(base: str, name: str, labels: str = "") -> float:
    """The sum of `mlxd_<name>` over its label sets (those containing `labels` only)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    found = re.finditer(rf"^mlxd_{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
    return sum(float(m.group(2)) for m in found if labels in (m.group(1) or ""))


def arrays_held(base: str) -> float:
    """Bytes of MLX arrays the server holds outside its RAM cache tier (weights, adapters)."""
    ram = metric(base, "prefix_cache_bytes", 'tier="ram"')
    return metric(base, "memory_arrays_bytes") - ram


@dataclass(frozen=True)
class Reply:
    """One response's token count and the server's own split of its time (seconds)."""

    tokens: int
    prompt: float  # prompt_eval_duration
    decode: float  # eval_duration
    total: float  # total_duration


def one(pool: httpx.Client, base: str, model: str, prompt: str, tokens: int) -> Reply:
    body = {
        "model": model, "prompt": prompt, "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": tokens, "draft_method": "off"},
    }  # fmt: skip
    r = pool.post(f"{base}/api/generate", json=body)
    r.raise_for_status()
    out = r.json()
    return Reply(
        int(out["eval_count"]),
        out.get("prompt_eval_duration", 0) / 1e9,
        out.get("eval_duration", 0) / 1e9,
        out.get("total_duration", 0) / 1e9,
    )


@dataclass(frozen=True)
class Burst:
    replies: list[Reply]
    wall: float  # seconds
    cpu: float  # the server's CPU seconds

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replies)

    @property
    def rate(self) -> float:
        return self.tokens / self.wall

    @property
    def per_cpu(self) -> float:
        return self.tokens / self.cpu

    def totals_ms(self) -> tuple[float, float, float]:
        """Median, mean and max of the requests' total_duration: a mean far above the median
        says a few requests stalled (what the decode median cannot show)."""
        totals = [r.total * 1e3 for r in self.replies]
        return statistics.median(totals), statistics.fmean(totals), max(totals)

    def split_ms(self) -> tuple[float, float, float]:
        """Medians over the replies: decode ms per token, prompt ms, and ms of a request's
        total spent neither reading its prompt nor decoding (queueing, admission, mounting)."""
        decode = statistics.median(r.decode / max(r.tokens, 1) for r in self.replies)
        prompt = statistics.median(r.prompt for r in self.replies)
        rest = statistics.median(r.total - r.prompt - r.decode for r in self.replies)
        return decode * 1e3, prompt * 1e3, rest * 1e3


@contextlib.contextmanager
def profiled(folder: Path | None, pid: int, name: str) -> Iterator[None]:
    """Within: py-spy samples the server (every thread, idle frames too) into
    `folder/name.txt`, collapsed stacks; nothing when `folder` is None."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    cmd = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
           "--idle", "--threads", "--output", str(folder / f"{name}.txt")]  # fmt: skip
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached before the burst starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)


def burst(
    base: str, pid: int, models: list[str], clients: int, requests: int, tokens: int
) -> Burst:
    """Each client sends `requests` in a row, rotating over `models`: tokens, wall, CPU."""

    def client(pool: httpx.Client, i: int) -> list[Reply]:
        return [
            one(pool, base, models[(i + j) % len(models)], PROMPTS[(i + j) % len(PROMPTS)], tokens)
            for j in range(requests)
        ]

    cpu = cpu_seconds(pid)
    results, wall = released_at_once(clients, client)
    return Burst([r for replies in results for r in replies], wall, cpu_seconds(pid) - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--workdir", type=Path, default=WORKDIR)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="requests per client per burst")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16, help="adapted blocks, from the last")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="record the server with py-spy during every burst, one raw profile per burst here",
    )
    args = ap.parse_args()

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    adapters = train(args.model, work, args.layers)
    names = [f"adapter{i}" for i in range(len(adapters))]
    registry = work / "models.yaml"
    lines = ["models:", f"  base:\n    target: {args.model.resolve()}"]
    for name, path in zip(names, adapters, strict=True):
        lines.append(f"  {name}:\n    target: {args.model.resolve()}\n    adapters: [{path}]")
    registry.write_text("\n".join(lines) + "\n", encoding="utf-8")
    port = free_port()
    home = work / "home"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXD_HOME": str(home),
           "MLXD_HOST": f"127.0.0.1:{port}", "MLXD_CACHE_SSD": "0", "MLXD_NUM_PARALLEL": "8"}  # fmt: skip
    cmd = [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(base, proc)
        with httpx.Client(timeout=900) as pool:
            one(pool, base, "base", PROMPTS[0], 8)
            rss_base, arrays_base = rss_bytes(proc.pid), arrays_held(base)
            for name in names:
                one(pool, base, name, PROMPTS[0], 8)
            rss_adapters, arrays_adapters = rss_bytes(proc.pid), arrays_held(base)
        adapter_bytes = metric(base, "adapter_bytes")
        files = sum((p / "adapters.safetensors").stat().st_size for p in adapters)
        print(
            f"\nmodel {args.model}  adapted blocks {args.layers}  tokens {args.tokens}"
            f"  requests/client {args.requests}"
        )
        print(
            f"{'clients':>7} {'base tok/s':>11} {'4 adapters':>11} {'ratio':>6}"
            f" {'base tok/cpu-s':>15} {'4 adapters':>11} {'ratio':>6}"
            f" {'first: base':>12} {'4 adapters':>11}"
        )
        splits = []
        for clients in [int(c) for c in args.clients.split(",")]:
            plain, mixed = [], []
            arms = (("base", ["base"], plain), ("adapters", names, mixed))
            first = {  # what this client count costs once (shapes, kernels), measured apart
                arm: burst(base, proc.pid, models, clients, args.requests, args.tokens)
                for arm, models, _ in arms
            }
            for r in range(args.rounds):
                for arm, models, into in arms:
                    with profiled(args.profile, proc.pid, f"{arm}-{clients}-{r}"):
                        into.append(
                            burst(base, proc.pid, models, clients, args.requests, args.tokens)
                        )
            for arm, _, bursts in arms:
                rates = ", ".join(f"{b.rate:.1f}" for b in bursts)
                print(f"  {clients} clients, {arm} bursts: {rates} tok/s", flush=True)
            p = statistics.median(b.rate for b in plain)
            m = statistics.median(b.rate for b in mixed)
            pc = statistics.median(b.per_cpu for b in plain)
            mc = statistics.median(b.per_cpu for b in mixed)
            print(
                f"{clients:>7} {p:>11.1f} {m:>11.1f} {m / p:>6.2f}"
                f" {pc:>15.1f} {mc:>11.1f} {mc / pc:>6.2f}"
                f" {first['base'].rate:>12.1f} {first['adapters'].rate:>11.1f}",
                flush=True,
            )
            splits += [(clients, "base", plain[-1]), (clients, "4 adapters", mixed[-1])]
        print("\nthe server's split of a request (medians, last round; ms) and its total")
        print(
            f"{'clients':>7} {'arm':>10} {'decode/token':>13} {'prompt':>8} {'rest':>8}"
            f" | {'total: median':>13} {'mean':>7} {'max':>7}"
        )
        for clients, arm, b in splits:
            decode, prompt, rest = b.split_ms()
            mid, mean, top = b.totals_ms()
            print(
                f"{clients:>7} {arm:>10} {decode:>13.2f} {prompt:>8.1f} {rest:>8.1f}"
                f" | {mid:>13.1f} {mean:>7.1f} {top:>7.1f}"
            )
        rss_end, arrays_end = rss_bytes(proc.pid), arrays_held(base)
        loads = metric(base, "model_loads_total")
        print(f"\nbase loads: {loads:.0f} (reloads: {loads - 1:.0f})")
        print(
            f"resident: {rss_base / 2**20:.1f} MiB with the base loaded,"
            f" {rss_adapters / 2**20:.1f} MiB with 4 adapters mounted"
            f" (+{(rss_adapters - rss_base) / 2**20:.1f} MiB);"
            f" adapters resident {adapter_bytes / 2**20:.2f} MiB"
            f" ({files / 2**20:.2f} MiB of adapter files)"
        )
        print(
            f"MLX arrays, the RAM cache tier left out: {arrays_base / 2**20:.1f} MiB with the base,"
            f" {arrays_adapters / 2**20:.1f} MiB with 4 adapters"
            f" (+{(arrays_adapters - arrays_base) / 2**20:.1f} MiB)"
        )
        print(
            f"after every burst: resident {rss_end / 2**20:.1f} MiB"
            f" (+{(rss_end - rss_base) / 2**20:.1f} MiB over the base loaded),"
            f" MLX arrays {arrays_end / 2**20:.1f} MiB"
            f" (+{(arrays_end - arrays_base) / 2**20:.1f} MiB)"
        )
        print(json.dumps({"adapter_bytes": adapter_bytes, "loads": loads}))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
