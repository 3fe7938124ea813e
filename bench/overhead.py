"""Serving overhead: mlxd's decode rate over HTTP streaming next to mlx-lm's `generate_step`
in-process, same model, same prompts, same run.

    python bench/overhead.py [--model ../shared/models/code-pair/target] [--tokens 128]

mlxd runs as a real daemon (`mlxd serve` in a subprocess on a free loopback port) with
speculation off, so the ratio isolates the server: HTTP, NDJSON, detokenizing, scheduling. The
decode rate excludes the prompt: tokens after the first / time from the first to the last.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mlxlm_rate(model: object, prompt: list[int], tokens: int) -> float:
    stamps = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=tokens):  # type: ignore[arg-type]
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def mlxd_rate(base: str, model: str, prompt: str, tokens: int, method: str) -> tuple[float, float]:
    """(client-side decode rate over the stream, server-reported eval rate)."""
    body = {
        "model": model, "prompt": prompt, "raw": True, "stream": True,
        "options": {"temperature": 0, "num_predict": tokens, "draft_method": method, "stop": []},
    }  # fmt: skip
    stamps: list[float] = []
    final: dict = {}
    with httpx.stream("POST", f"{base}/api/generate", json=body, timeout=600) as r:
        for line in r.iter_lines():
            obj = json.loads(line)
            if obj.get("done"):
                final = obj
            elif obj.get("response"):
                stamps.append(time.perf_counter())
    client = (final["eval_count"] - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    server = final["eval_count"] / (final["eval_duration"] / 1e9)
    return client, server


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=ROOT.parent / "shared/models/code-pair/target")
    ap.add_argument(
        "--prompts", type=Path, default=None, help="heldout_prompts.json (default: beside --model)"
    )
    ap.add_argument("--count", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    prompts_file = args.prompts or args.model.parent / "heldout_prompts.json"
    prompts = [p["prompt"] for p in json.loads(prompts_file.read_text())["code"][: args.count]]

    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    registry = home / "models.yaml"
    registry.write_text(
        f"models:\n  bench:\n    target: {args.model.resolve()}\n", encoding="utf-8"
    )
    port = free_port()
    env = {
        **os.environ,
        "MLXD_HOME": str(home),
        "MLXD_HOST": f"127.0.0.1:{port}",
        "HF_HUB_OFFLINE": "1",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("mlxd serve did not start")
            time.sleep(0.2)
        model, tokenizer = load(str(args.model))[:2]
        ids = [list(tokenizer.encode(p)) for p in prompts]
        # warm both sides
        mlxlm_rate(model, ids[0], 16)
        mlxd_rate(base, "bench", prompts[0], 16, "off")
        rows = []
        for prompt, prompt_ids in zip(prompts, ids, strict=True):
            ref = mlxlm_rate(model, prompt_ids, args.tokens)
            client, server_rate = mlxd_rate(base, "bench", prompt, args.tokens, "off")
            rows.append((ref, client, server_rate))
        ref = statistics.median(r[0] for r in rows)
        client = statistics.median(r[1] for r in rows)
        server_side = statistics.median(r[2] for r in rows)
        print(
            f"device {mx.default_device()}  model {args.model}  {len(prompts)} prompts x {args.tokens} tokens"
        )
        print(f"{'':<40}{'decode tok/s':>14}")
        print(f"{'mlx-lm generate_step (in-process)':<40}{ref:>14.1f}")
        print(f"{'mlxd over HTTP, client side':<40}{client:>14.1f}")
        print(f"{'mlxd, server-reported eval rate':<40}{server_side:>14.1f}")
        print(f"ratio mlxd (client) / mlx-lm: {client / ref:.3f}   (goal >= 0.97)")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
