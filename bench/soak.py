"""Soak: many mixed requests at once against a real daemon, then what they left behind.

    python bench/soak.py [--requests 1000] [--concurrency 16] [--tokens 24] [--parallel N]

Starts `mlxd serve` on the embedded `tiny` pairing and sends a deterministic mix: native
generate and chat and OpenAI chat and completions, streaming and not, draft method `model`,
`lookup` or `off` (the `/v1` routes take the pairing's default), temperature 0 and 0.7, and
about 10% of the streams dropped by the client after their first chunk. Every temperature-0
prompt is first run alone with speculation off; each concurrent temperature-0 answer must
equal it. Prints: answers by status, 5xx, hangs (requests past `--hang` seconds), transport
errors, error lines inside streams, temperature-0 answers identical to their lone run, rows
and queued requests left once the burst is over (from `/metrics`), and the daemon's resident
memory growth from after warm-up to the end (goal: at most 10%).

`tests/fault/test_soak.py` runs the same driver, smaller, in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("generate", "chat", "v1chat", "v1completions")
METHODS = ("model", "lookup", "off")
PROMPTS = (
    "def fib(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\ndef list_files(path):",
    "def is_prime(n):\n    ",
    "for i in range(10):",
    "def parse_args(argv):",
    "with open(path) as f:",
    "def merge(a, b):\n    out = []",
)
REGISTRY = (
    "models:\n  tiny:\n    target: embedded:tiny/target\n    draft: embedded:tiny/draft\n"
    "    draft_tokens: 3\n"
)


@dataclass(frozen=True)
class Job:
    kind: str  # one of KINDS
    prompt: str
    stream: bool
    method: str  # draft method; "auto" (the default) on /v1
    temperature: float
    disconnect: bool  # the client leaves after the first chunk


@dataclass
class Outcome:
    job: Job
    status: int | None = None  # None: no answer (transport error or hang)
    text: str = ""
    stream_error: str | None = None  # an error line inside a 200 stream
    transport_error: str | None = None
    hung: bool = False


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    lone: dict[tuple[str, str], str] = field(default_factory=dict)
    seconds: float = 0.0
    leftover_rows: float = -1.0
    leftover_queue: float = -1.0
    rss_warm: int = 0
    rss_end: int = 0
    counted: float = -1.0  # generation-route requests /metrics counted (lone runs included)

    @property
    def statuses(self) -> Counter[str]:
        return Counter(str(o.status) for o in self.outcomes)

    @property
    def five_xx(self) -> int:
        return sum(1 for o in self.outcomes if o.status is not None and o.status >= 500)

    @property
    def hangs(self) -> int:
        return sum(1 for o in self.outcomes if o.hung)

    @property
    def transport_errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.transport_error and not o.hung]

    @property
    def stream_errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.stream_error]

    @property
    def disconnects(self) -> int:
        return sum(1 for o in self.outcomes if o.job.disconnect)

    def greedy_checked(self) -> list[Outcome]:
        """Temperature-0 answers that ran to the end."""
        return [
            o
            for o in self.outcomes
            if o.job.temperature == 0 and not o.job.disconnect and o.status == 200
            and not o.stream_error
        ]  # fmt: skip

    def greedy_mismatches(self) -> list[Outcome]:
        return [o for o in self.greedy_checked() if o.text != self.lone[o.job.kind, o.job.prompt]]

    @property
    def sent(self) -> int:
        return len(self.outcomes) + len(self.lone)

    @property
    def rss_growth(self) -> float:
        return (self.rss_end - self.rss_warm) / self.rss_warm if self.rss_warm else 0.0

    def lines(self) -> list[str]:
        checked, mismatched = self.greedy_checked(), self.greedy_mismatches()
        out = [
            f"requests {len(self.outcomes)} in {self.seconds:.1f}s "
            f"(disconnects {self.disconnects}); by status {dict(sorted(self.statuses.items()))}",
            f"5xx {self.five_xx}   hangs {self.hangs}   transport errors "
            f"{len(self.transport_errors)}   error lines in streams {len(self.stream_errors)}",
            f"temperature 0 identical to lone run: {len(checked) - len(mismatched)}/{len(checked)}",
            f"left after: rows running {self.leftover_rows:g}, queued {self.leftover_queue:g}",
            f"/metrics counted {self.counted:g} of {self.sent} generation requests sent",
        ]
        if self.rss_warm:
            out.append(
                f"RSS after warm-up {self.rss_warm / 2**20:.1f} MiB, at end "
                f"{self.rss_end / 2**20:.1f} MiB: growth {self.rss_growth * 100:+.1f}% (goal <= 10%)"
            )
        for o in mismatched[:3]:
            lone = self.lone[o.job.kind, o.job.prompt]
            out.append(f"  mismatch {o.job}: {o.text[:60]!r} vs lone {lone[:60]!r}")
        for o in [*self.transport_errors, *self.stream_errors][:3]:
            out.append(f"  error {o.job}: {o.transport_error or o.stream_error}")
        return out


def make_jobs(count: int, seed: int = 0) -> list[Job]:
    """A deterministic mix; about 10% of all requests are streams the client drops."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        kind = rng.choice(KINDS)
        stream = rng.random() < 0.5
        jobs.append(
            Job(
                kind=kind,
                prompt=rng.choice(PROMPTS),
                stream=stream,
                method="auto" if kind.startswith("v1") else rng.choice(METHODS),
                temperature=rng.choice((0.0, 0.7)),
                disconnect=stream and rng.random() < 0.2,
            )
        )
    return jobs


def request_body(job: Job, model: str, tokens: int) -> tuple[str, dict[str, Any]]:
    """The route and JSON body for `job`."""
    messages = [{"role": "user", "content": job.prompt}]
    if job.kind in ("generate", "chat"):
        options = {
            "temperature": job.temperature,
            "num_predict": tokens,
            "draft_method": job.method,
        }
        base: dict[str, Any] = {"model": model, "stream": job.stream, "options": options}
        if job.kind == "generate":
            return "/api/generate", {**base, "prompt": job.prompt}
        return "/api/chat", {**base, "messages": messages}
    base = {
        "model": model,
        "stream": job.stream,
        "max_tokens": tokens,
        "temperature": job.temperature,
    }
    if job.kind == "v1chat":
        return "/v1/chat/completions", {**base, "messages": messages}
    return "/v1/completions", {**base, "prompt": job.prompt}


def text_of(kind: str, obj: dict[str, Any]) -> str:
    """The text one JSON object (a whole answer or a stream chunk) carries."""
    if kind == "generate":
        return str(obj.get("response") or "")
    if kind == "chat":
        return str((obj.get("message") or {}).get("content") or "")
    choices = obj.get("choices") or [{}]
    if kind == "v1chat":
        part = choices[0].get("delta") or choices[0].get("message") or {}
        return str(part.get("content") or "")
    return str(choices[0].get("text") or "")


def run_one(client: httpx.Client, job: Job, model: str, tokens: int, hang: float) -> Outcome:
    route, body = request_body(job, model, tokens)
    out = Outcome(job)
    started = time.monotonic()
    try:
        with client.stream("POST", route, json=body, timeout=hang) as r:
            out.status = r.status_code
            if not job.stream or r.status_code != 200:
                data = r.read()
                if r.status_code == 200:
                    out.text = text_of(job.kind, json.loads(data))
                return out
            parts = []
            for line in r.iter_lines():
                if time.monotonic() - started > hang:
                    out.hung = True
                    return out
                payload = line[6:] if line.startswith("data: ") else line
                if not payload.strip() or payload == "[DONE]":
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    out.stream_error = str(obj["error"])
                    break
                parts.append(text_of(job.kind, obj))
                if job.disconnect and any(parts):
                    break  # leaving the block closes the connection mid-stream
            out.text = "".join(parts)
    except httpx.TimeoutException:
        out.hung = True
    except (httpx.HTTPError, ValueError) as exc:
        out.transport_error = f"{type(exc).__name__}: {exc}"
    if time.monotonic() - started > hang:
        out.hung = True
    return out


GENERATION_ROUTES = ("/api/generate", "/api/chat", "/v1/chat/completions", "/v1/completions")


def scrape(base: str) -> dict[str, float]:
    """`/metrics` summed per metric name; requests to the generation routes as `generation`."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    text = httpx.get(f"{base}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
            if s.name == "mlxd_http_requests_total" and s.labels["route"] in GENERATION_ROUTES:
                sums["generation"] = sums.get("generation", 0.0) + s.value
    return sums


def run_soak(
    base: str,
    count: int,
    concurrency: int,
    *,
    model: str = "tiny",
    tokens: int = 24,
    hang: float = 180.0,
    seed: int = 0,
    rss: Callable[[], int] | None = None,
    settle: float = 60.0,
) -> Report:
    """Lone temperature-0 runs first, then `count` requests `concurrency` at a time; `rss`
    (the daemon's resident bytes) is read once a tenth of them are done, and at the end."""
    report = Report()
    jobs = make_jobs(count, seed)
    with httpx.Client(base_url=base, timeout=hang) as lone_client:
        for kind, prompt in sorted({(j.kind, j.prompt) for j in jobs if j.temperature == 0}):
            lone = Job(kind, prompt, stream=False, method="off", temperature=0.0, disconnect=False)
            if kind.startswith("v1"):
                lone = Job(kind, prompt, False, "auto", 0.0, False)
            done = run_one(lone_client, lone, model, tokens, hang)
            if done.status != 200:
                raise RuntimeError(f"lone run failed: {done}")
            report.lone[kind, prompt] = done.text
    warm_at = max(1, count // 10)
    finished = 0
    lock = threading.Lock()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    with httpx.Client(base_url=base, timeout=hang, limits=limits) as client:

        def one(job: Job) -> Outcome:
            nonlocal finished
            out = run_one(client, job, model, tokens, hang)
            with lock:
                finished += 1
                if finished == warm_at and rss is not None:
                    report.rss_warm = rss()
            return out

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            report.outcomes = list(pool.map(one, jobs))
        report.seconds = time.perf_counter() - t0

    deadline = time.monotonic() + settle
    while True:
        sums = scrape(base)
        report.leftover_rows = sums.get("mlxd_rows_running", -1.0)
        report.leftover_queue = sums.get("mlxd_queue_depth", -1.0)
        report.counted = sums.get("generation", 0.0)
        settled = (report.leftover_rows, report.leftover_queue) == (0, 0)
        if (settled and report.counted >= report.sent) or time.monotonic() > deadline:
            break  # (a dropped stream's request is counted once its handler has returned)
        time.sleep(0.2)
    if rss is not None:
        report.rss_end = rss()
    return report


def vm_rss(pid: int) -> int:
    """Resident bytes of process `pid` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--hang", type=float, default=180.0, help="seconds that count as a hang")
    ap.add_argument("--parallel", type=int, default=None, help="MLXD_NUM_PARALLEL for mlxd")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="mlxd-soak-"))
    registry = home / "models.yaml"
    registry.write_text(REGISTRY, encoding="utf-8")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLXD_HOME": str(home), "MLXD_HOST": f"127.0.0.1:{port}"}
    env["HF_HUB_OFFLINE"] = "1"
    if args.parallel:
        env["MLXD_NUM_PARALLEL"] = str(args.parallel)
    log = (home / "serve.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"mlxd serve did not start (log: {home / 'serve.log'})")
            time.sleep(0.2)
        report = run_soak(
            base, args.requests, args.concurrency, tokens=args.tokens, hang=args.hang,
            seed=args.seed, rss=lambda: vm_rss(server.pid),
        )  # fmt: skip
        print(
            f"mlxd soak: embedded tiny pairing, {args.concurrency} concurrent, "
            f"{args.tokens} tokens per request (log: {home / 'serve.log'})"
        )
        for line in report.lines():
            print(line)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
