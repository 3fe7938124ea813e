"""Embedding throughput: mlxd's /api/embed over HTTP next to the same model's forward
in-process (`Embedder.embed`: tokenizing, padded forwards, pooling), for batch sizes 1, 8 and
64, in one run; and the served vectors next to an independent reference implementation.

    python bench/embed.py [--model DIR] [--words 48] [--rounds 5]

Without --model it builds an all-MiniLM-L6-v2-shaped BERT (384 wide, 6 layers, random
weights, a small WordPiece vocabulary) and compares vectors with the numpy reference forward
of the tests; sentence-transformers is used as the reference instead when it is installed and
--model is a real sentence-transformers directory. mlxd runs as a real daemon (`mlxd serve` in
a subprocess on a free loopback port); the two sides take turns, round after round, and the
medians are compared. Goal: HTTP / in-process >= 0.9 at every batch size.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxd.engine.backend import configure_backend  # noqa: E402

BACKEND = configure_backend()  # as `mlxd serve` does, before MLX computes anything

# isort: split
import httpx  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxd.engine.embedding.model import EmbedRequest, load_embedder  # noqa: E402
from mlxd.registry.schema import ModelEntry  # noqa: E402
from tests.embed.reference import Reference  # noqa: E402
from tests.fixtures.tiny_embedders import CORPUS, build_wordpiece, write_bert  # noqa: E402

BATCHES = (1, 8, 64)
MINILM_SHAPE = {"hidden": 384, "layers": 6, "heads": 12, "intermediate": 1536, "max_positions": 512}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def texts(count: int, words: int, seed: int) -> list[str]:
    """Chunks of about `words` words (±25%), as a RAG indexer sends them."""
    vocab = CORPUS.split()
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(words * 3 // 4, words * 5 // 4)))
        for _ in range(count)
    ]


def start_server(model: Path, home: Path) -> tuple[subprocess.Popen[bytes], str]:
    registry = home / "models.yaml"
    registry.write_text(f"models:\n  bench:\n    target: {model}\n", encoding="utf-8")
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
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(base, timeout=1).status_code == 200:
                return server, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("mlxd serve did not start")
        time.sleep(0.2)


def reference_vectors(model: Path, pooling: str, inputs: list[str]) -> tuple[str, np.ndarray]:
    """(name, unit vectors) from sentence-transformers when it is installed and can read
    `model`, else from the numpy reference forward."""
    try:
        from sentence_transformers import SentenceTransformer  # type: ignore[import-not-found]

        st = SentenceTransformer(str(model), device="cpu")
        return "sentence-transformers", np.asarray(st.encode(inputs, normalize_embeddings=True))
    except Exception:
        ref = Reference(model, pooling)
        return "numpy reference forward", np.stack([ref.embed(t) for t in inputs])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None, help="an embedding model directory")
    ap.add_argument("--words", type=int, default=48, help="words per input (about)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="mlxd-bench-embed-"))
    model = args.model
    if model is None:
        tokenizer = build_wordpiece(home / "wordpiece")
        model = write_bert(home / "all-MiniLM-L6-shaped", tokenizer, seed=1, **MINILM_SHAPE)
    model = model.resolve()

    embedder = load_embedder(ModelEntry(name="bench", target=str(model)), BACKEND)
    server, base = start_server(model, home)
    try:
        client = httpx.Client(timeout=600)

        def over_http(batch: list[str]) -> list[list[float]]:
            r = client.post(f"{base}/api/embed", json={"model": "bench", "input": batch})
            r.raise_for_status()
            vectors: list[list[float]] = r.json()["embeddings"]
            return vectors

        def in_process(batch: list[str]) -> list[list[float]]:
            vectors: list[list[float]] = embedder.embed(EmbedRequest(tuple(batch))).vectors.tolist()
            return vectors

        over_http(texts(2, args.words, 0))  # load and warm both sides
        in_process(texts(2, args.words, 0))
        print(f"device {mx.default_device()}  model {model}  spec {embedder.spec}")
        print(f"inputs of ~{args.words} words, {args.rounds} rounds, medians")
        print(f"{'batch':>6}{'in-process emb/s':>20}{'/api/embed emb/s':>20}{'ratio':>9}")
        print("(ratio: the median of each round's /api/embed over in-process, taken back to back)")
        for size in BATCHES:
            calls = max(1, 16 // size)  # calls per turn: small batches are timed over several
            local, served, paired = [], [], []
            for r in range(args.rounds):
                batch = texts(size, args.words, seed=1000 * size + r)
                turns = (in_process, over_http) if r % 2 == 0 else (over_http, in_process)
                rates = {}
                for side in turns:  # alternate who goes first: a busy spell hits both sides
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        side(batch)
                    rates[side] = size * calls / (time.perf_counter() - t0)
                local.append(rates[in_process])
                served.append(rates[over_http])
                paired.append(rates[over_http] / rates[in_process])
            a, b = statistics.median(local), statistics.median(served)
            print(f"{size:>6}{a:>20.1f}{b:>20.1f}{statistics.median(paired):>9.3f}")

        sample = texts(16, args.words, seed=7)
        got = np.array(over_http(sample))
        name, expected = reference_vectors(model, embedder.spec.pooling, sample)
        diff = float(np.abs(got - expected).max())
        cos = float(np.min(np.sum(got * expected, axis=1)))
        print(
            f"vectors vs {name}: max |diff| {diff:.2e}, min cosine {cos:.6f} ({len(sample)} inputs)"
        )
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
