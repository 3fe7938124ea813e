"""Where a served round's time goes: the daemon in this process, timed inside its runner.

    python bench/served_rounds.py [--model DIR | --shape 8b] [--draft DIR] [--method auto]
                                  [--adapter DIR ...] [--clients 1,8] [--tokens 128]

`bench/concurrency.py` says how fast streams are served; this says why. The daemon serves the
model here (`mlxd serve`, real uvicorn on loopback) with timers on its runner thread, while a
client process sends bursts of streaming completions (`bench.concurrency.burst`, released at
once). For each client count it prints the burst's aggregate and per-stream rates, then:
- the runner's parts per decoding step (a lone row's `Generation.step` or a batch round), wall
  and thread CPU time: building a round's graph (`RowBatch._forward`), MLX encoding it
  (`mx.async_eval`; on a GPU this is where kernel launches go), waiting for the device
  (`to_ints`), a verify round's sampling (`choices`, grammar walks) and its one sync
  (`mx.eval`: encoding and waiting), drafting, streaming (`Scheduler._push`), the hand-over to
  the event loop;
- the rounds by kind (plain: queued ahead, queued by a verify round before its verdicts were
  read, or fresh; verify, by rows x width) and their mean,
  and the slowest rounds with what they spent;
- how many batch rows asked to draft (and whether their speculation was on), and how many
  drafts the batch's plan let them make;
- the first steps of the burst (when requests arrived, prompts were read, rounds ran);
- every busy thread's CPU share (the event loop is the main thread).
A part whose wall time exceeds its CPU time waited (for the GIL, the device or a lock).

`--native DIR` also samples each measured burst with `py-spy --native` (on PATH; it pauses the
process to read native stacks, so rates fall) into `DIR/<clients>.txt`, collapsed stacks, and
prints where the runner's `mx.async_eval` and `mx.eval` calls spend their time inside MLX.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxd.engine.backend import configure_backend

configure_backend()  # first, as `mlxd serve` does

# isort: split
import mlx.core as mx
from starlette import routing

from mlxd.daemon import cli
from mlxd.engine import batch, draftbatch, generation, runner, scheduler

SLOW = 0.04  # a round this long is listed with its parts
EARLY = 40  # events of a burst's start that are listed


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each of this process's threads (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


class Timers:
    """Wall and CPU seconds per timed part, counted on the runner thread only."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (a burst begins)."""
        self.wall: defaultdict[str, float] = defaultdict(float)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.kinds: defaultdict[str, float] = defaultdict(float)
        self.kind_n: Counter[str] = Counter()
        self.slow: list[str] = []
        self.early: list[str] = []
        self.wants: Counter[str] = Counter()  # batch rows' draft lengths asked, and planned
        self.kind = ""
        self.steps = 0  # scheduler steps that decoded (a lone row's step or a batch round)
        self.start = time.perf_counter()
        self.threads = thread_cpu()

    def note(self, what: str) -> None:
        if len(self.early) < EARLY:
            self.early.append(f"+{(time.perf_counter() - self.start) * 1e3:8.1f} ms {what}")


T = Timers()


def on_runner() -> bool:
    return threading.current_thread().name.startswith("runner")


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not on_runner():
            return fn(*args, **kwargs)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            T.wall[name] += time.perf_counter() - t0
            T.cpu[name] += time.thread_time() - c0
            T.calls[name] += 1

    return wrapper


def wrap(owner: Any, names: str, prefix: str) -> None:
    for name in names.split():
        setattr(owner, name, timed(f"{prefix}.{name}", getattr(owner, name)))


def install() -> None:
    """Timers on the runner's loop; round kinds; the burst's first events."""
    wrap(scheduler.Scheduler, "_push _admit _offer_finished _prefill_step", "Scheduler")
    wrap(batch.RowBatch, "_forward _next_is_plain join leave keep", "RowBatch")
    wrap(draftbatch.DraftBatch, "propose join leave", "DraftBatch")
    wrap(generation.Generation, "step ready_source absorb walk", "Generation")
    wrap(runner.Outbox, "flush", "Outbox")
    batch.to_ints = timed("to_ints (device wait)", batch.to_ints)
    batch.choices = timed("choices (verify sampling)", batch.choices)
    encode = timed("mx.async_eval (encoding)", mx.async_eval)
    settle = timed("mx.eval (verify: encoding and device wait)", mx.eval)
    batch.mx = _Shim(mx, async_eval=encode, eval=settle)  # the batch module's MLX, timed
    generation.mx = batch.mx  # and a lone row's: its step's encoding apart from building
    generation.to_int = timed("to_int (device wait)", generation.to_int)
    generation.to_ints = batch.to_ints

    round_, plain, propose, guessed = (
        batch.RowBatch.round,
        batch.RowBatch._plain_round,
        batch.RowBatch._propose,
        batch.RowBatch._guessed_round,
    )

    def timed_round(self: batch.RowBatch) -> Any:
        if not on_runner():
            return round_(self)
        T.kind, before, t0 = "?", dict(T.wall), time.perf_counter()
        try:
            return round_(self)
        finally:
            took = time.perf_counter() - t0
            T.kinds[T.kind] += took
            T.kind_n[T.kind] += 1
            if took > SLOW and len(T.slow) < 12:
                parts = {k: f"{(v - before.get(k, 0)) * 1e3:.1f}" for k, v in T.wall.items()
                         if v - before.get(k, 0) > 0.002}  # fmt: skip
                T.slow.append(f"{T.kind} {took * 1e3:.0f} ms {parts}")

    def kind_plain(self: batch.RowBatch, since: float | None = None) -> Any:
        ahead = self.ahead
        how = "fresh" if ahead is None else "queued unread" if ahead.unread else "ahead"
        T.kind = f"plain {len(self.gens)} rows {how}"
        return plain(self, since)

    def kind_guessed(self: batch.RowBatch, since: float | None) -> Any:
        ahead = self.ahead
        width = ahead.width if ahead is not None else 0
        T.kind = f"verify {len(self.gens)}x{width} queued on guesses"
        return guessed(self, since)

    def kind_verify(self: batch.RowBatch, ks: list[int]) -> Any:
        drafts = propose(self, ks)
        T.kind = f"verify {len(self.gens)}x{1 + max(d.count for d in drafts)}"
        return drafts

    def counted_plan(gens: Any, wants: list[int], *args: Any) -> list[int]:
        ks = plan(gens, wants, *args)
        if on_runner():
            T.wants["rows asking to draft"] += sum(w > 0 for w in wants)
            T.wants["rows planned to draft"] += sum(k > 0 for k in ks)
            T.wants["tokens asked"] += sum(wants)
            T.wants["tokens planned"] += sum(ks)
        return ks

    def counted_length(self: generation.Generation, ready: bool = True) -> int:
        k = draft_length(self, ready)
        if on_runner() and not ready:
            state = "on" if self.spec.on else "not on"
            T.wants[f"batch rows asked: spec {state}, wants {'some' if k else 'none'}"] += 1
        return k

    plan, draft_length = batch.plan_widths, generation.Generation.draft_length
    batch.plan_widths = counted_plan
    generation.Generation.draft_length = counted_length  # type: ignore[method-assign]
    batch.RowBatch.round = timed_round  # type: ignore[method-assign]
    batch.RowBatch._plain_round = kind_plain  # type: ignore[method-assign]
    batch.RowBatch._propose = kind_verify  # type: ignore[method-assign]
    batch.RowBatch._guessed_round = kind_guessed  # type: ignore[method-assign]

    step, prefill, handle = (
        scheduler.Scheduler._step,
        scheduler.Scheduler._prefill_step,
        routing.Route.handle,
    )

    def noted_step(self: scheduler.Scheduler) -> None:
        t0 = time.perf_counter()
        step(self)
        T.steps += 1
        T.note(f"round {(time.perf_counter() - t0) * 1e3:6.1f} ms, {len(self.rows)} rows")

    def noted_prefill(self: scheduler.Scheduler) -> None:
        t0, n = time.perf_counter(), len(self.prefilling)
        prefill(self)
        T.note(f"prompts {(time.perf_counter() - t0) * 1e3:6.1f} ms, {n} read")

    async def noted_handle(self: routing.Route, scope: Any, receive: Any, send: Any) -> None:
        T.note(f"request {scope.get('path')}")
        await handle(self, scope, receive, send)

    scheduler.Scheduler._step = noted_step  # type: ignore[method-assign]
    scheduler.Scheduler._prefill_step = noted_prefill  # type: ignore[method-assign]
    routing.Route.handle = noted_handle  # type: ignore[method-assign]


class _Shim:
    """A module stand-in: `mx` with some attributes replaced."""

    def __init__(self, module: Any, **replaced: Any) -> None:
        self._module, self._replaced = module, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced.get(name) or getattr(self._module, name)


class Native:
    """py-spy sampling this process's native stacks during a burst (`--native`)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.spy: subprocess.Popen[bytes] | None = None

    def start(self, name: str) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"{name}.txt"
        cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--native", "--format", "raw",
               "--rate", "100", "--threads", "--output", str(self.path)]  # fmt: skip
        self.spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.spy is None:
            return
        self.spy.send_signal(signal.SIGINT)
        self.spy.wait(60)
        self.spy = None
        if self.path.exists():
            print_native(self.path)


def print_native(path: Path, top: int = 25) -> None:
    """The runner's samples: by its innermost Python frame, and inside MLX's evaluation by the
    frames below the call (collapsed stacks: `frame;frame;... count`)."""
    python: Counter[str] = Counter()
    inside: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    runner = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or "runner" not in stack.split(";", 1)[0]:
            continue
        runner += int(n)
        frames = [f.rsplit(" (", 1)[0] for f in stack.split(";")]
        python[
            next(
                (f for f in reversed(stack.split(";")) if ".py:" in f and "served_rounds" not in f),
                "?",
            )
        ] += int(n)
        at = next((i for i, f in enumerate(frames) if f in EVALS), None)
        if at is not None:
            inside[";".join(frames[at + 1 : at + 4])] += int(n)
            leaves[";".join(frames[-3:])] += int(n)
    print(f"  native samples of the runner: {runner}, in MLX's eval {sum(inside.values())}")
    for title, counts in (("innermost Python", python), ("eval's calls", inside),
                          ("eval's innermost", leaves)):  # fmt: skip
        print(f"  {title}:")
        for k, v in counts.most_common(top):
            print(f"    {v:6}  {k[:200]}")


EVALS = ("mlx::core::eval", "mlx::core::async_eval")
NATIVE = Native(None)


def report(*_: Any) -> None:
    NATIVE.stop()
    span = time.perf_counter() - T.start
    per = max(T.steps, 1)
    print(f"  {T.steps} steps ({sum(T.kind_n.values())} of them batch rounds) in {span:.2f} s")
    print(f"  {'part':30} {'wall ms/step':>12} {'cpu ms/step':>11} {'calls/step':>10}")
    for k in sorted(T.wall, key=lambda k: -T.wall[k]):
        print(f"  {k:30} {T.wall[k] / per * 1e3:12.3f} {T.cpu[k] / per * 1e3:11.3f} "
              f"{T.calls[k] / per:10.2f}")  # fmt: skip
    for k in sorted(T.kind_n, key=lambda k: -T.kinds[k])[:12]:
        print(f"  round {k:26} x{T.kind_n[k]:<4} {T.kinds[k] / T.kind_n[k] * 1e3:8.2f} ms each")
    for line in T.slow:
        print(f"  slow {line}")
    if T.wants:
        print("  drafts: " + ", ".join(f"{k} {v}" for k, v in T.wants.items()))
    for line in T.early:
        print(f"  {line}")
    now = thread_cpu()
    busiest = sorted(now, key=lambda t: T.threads.get(t, 0) - now[t])[:5]
    for tid in busiest:
        used = now[tid] - T.threads.get(tid, 0)
        with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
            name = f.read().strip() + (" (event loop)" if tid == os.getpid() else "")
        print(f"  thread {name}: {used / span:.0%} of a core")
    sys.stdout.flush()


DRIVER = """
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
from bench.concurrency import burst, wait_up
class Up:
    args = "mlxd"
    def poll(self): return None
base = "http://127.0.0.1:{port}"
wait_up(base + "/v1/models", Up())
prompts = {prompts!r}
for n in {clients!r}:
    for _ in range(2):
        burst(base, {models!r}, prompts, n, 32)  # warm: shapes, the prefix cache
    os.kill({pid}, signal.SIGUSR1)
    time.sleep(0.2)
    print(f"{{n}} clients: " + json.dumps(burst(base, {models!r}, prompts, n, {tokens})), flush=True)
    os.kill({pid}, signal.SIGUSR2)
    time.sleep(0.5)
os.kill({pid}, signal.SIGINT)
"""


def main() -> None:
    from bench.concurrency import SHAPES, code_pair, free_port, random_model

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=code_pair() / "target")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlxd-bench")
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--method", default="off", help="the entry's draft_method")
    ap.add_argument(
        "--adapter", type=Path, action="append", default=[],
        help="serve the model on this adapter; given more than once, clients take turns over "
        "them (rows of several adapters in every batch)",
    )  # fmt: skip
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument(
        "--heldout", action="store_true",
        help="the code pair's held-out code prompts (as `bench/concurrency.py --pairing` sends)",
    )  # fmt: skip
    ap.add_argument("--native", type=Path, default=None, help="py-spy --native profiles here")
    args = ap.parse_args()
    model = args.model
    if args.shape:
        model = random_model(args.workdir / f"random-{args.shape}", args.model, SHAPES[args.shape])
    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    entry = f"    target: {model.resolve()}\n"
    if args.draft:
        entry += f"    draft: {args.draft.resolve()}\n"
    entry += f"    options: {{draft_method: {args.method}}}\n"
    models = {"bench": entry}
    if args.adapter:  # one entry per adapter, all on the base loaded once
        models = {
            f"bench{i}": entry + f"    adapters: [{path.resolve()}]\n"
            for i, path in enumerate(args.adapter)
        }
    (home / "models.yaml").write_text(
        "models:\n" + "".join(f"  {name}:\n{body}" for name, body in models.items())
    )
    port = free_port()
    os.environ.update(HF_HUB_OFFLINE="1", MLXD_HOME=str(home), MLXD_HOST=f"127.0.0.1:{port}",
                      MLXD_NUM_PARALLEL="16")  # fmt: skip
    install()
    NATIVE.folder = args.native
    names = iter(args.clients.split(","))
    signal.signal(signal.SIGUSR1, lambda *_: (T.reset(), NATIVE.start(next(names, "burst"))))
    signal.signal(signal.SIGUSR2, report)
    clients = [int(c) for c in args.clients.split(",")]
    prompts = [
        f'def function_{i}(values, threshold={i}):\n    """Return the values above the threshold."""\n'
        for i in range(16)
    ]
    if args.heldout:
        held = json.loads((code_pair() / "heldout_prompts.json").read_text())
        prompts = [p["prompt"] for p in held["code"]][:16]
    driver = DRIVER.format(root=str(ROOT), port=port, clients=clients, tokens=args.tokens,
                           pid=os.getpid(), prompts=prompts, models=list(models))  # fmt: skip
    subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT)
    cli.main(["serve", "--registry", str(home / "models.yaml")])


if __name__ == "__main__":
    main()
