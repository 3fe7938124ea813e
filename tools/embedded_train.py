"""Train the embedded ``tiny`` target/draft pairing from the local Python stdlib.

mlxd ships one default pairing inside the repository so ``mlxd run tiny ...`` works
offline on a fresh machine. Downloading weights is not an option there, so this
script builds everything from text every Python install already has (the stdlib
sources): a byte-level BPE tokenizer with ChatML + FIM specials, a ~1M-parameter
Llama target and a much smaller Llama draft trained jointly on the same batches
(the draft also distils the target so speculative decoding accepts more tokens).

Run: ``python -m tools.embedded_train [--out registry/embedded/tiny] [--minutes 8]``.

Speed note: mlx's Linux CPU wheel links the reference (netlib) BLAS, about 10x
slower at matmuls than OpenBLAS. The script does not depend on it, but on Linux
``LD_PRELOAD=/path/to/libopenblas.so.0`` buys many more training tokens per minute.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import shutil
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_OUT",
    "DRAFT_SHAPE",
    "EOS_TOKEN_IDS",
    "HELD_OUT_FILES",
    "SPECIAL_TOKENS",
    "TARGET_SHAPE",
    "TOKENIZER_FILES",
    "ModelShape",
    "build_mix",
    "build_tokenizer",
    "load_corpus",
    "main",
    "train",
]

DEFAULT_OUT = Path("registry/embedded/tiny")

# The list index is the token id: the BPE trainer adds specials first, in order.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
)
EOT, IM_START, IM_END, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = range(len(SPECIAL_TOKENS))
# <|im_end|> first (chat turns end there), <|endoftext|> ends raw completions.
EOS_TOKEN_IDS: list[int] = [IM_END, EOT]
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_PROMPT_PREFIX = "Write a Python function: "

SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages"})
MAX_FILE_BYTES = 200_000
MAX_CORPUS_BYTES = 15_000_000
# Never trained on (nor seen by the tokenizer): the acceptance/held-out loss check
# needs text the models have not memorised.
HELD_OUT_FILES: tuple[str, ...] = ("textwrap.py", "heapq.py", "colorsys.py")

VOCAB_SIZE = 2048
SEQ_LEN = 256
FIM_SHARE = 0.15
CHAT_SHARE = 0.15
# Part of the chat examples use the bare ``def`` line as the user turn, so that a
# chat-templated prompt like "def fib(n):" (what ``mlxd run`` sends) yields code.
SIGNATURE_PROMPT_SHARE = 0.3


@dataclass(frozen=True)
class ModelShape:
    """Llama shape fields; kept small so both models fit in a few MB of float16."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """Per-head width; written explicitly so loaders need not infer it."""
        return self.hidden_size // self.num_attention_heads


TARGET_SHAPE = ModelShape(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=384,
)
DRAFT_SHAPE = ModelShape(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=192,
)


# --------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """Training and held-out stdlib sources, keyed by path relative to the stdlib."""

    train: dict[str, str] = field(default_factory=dict)
    held_out: dict[str, str] = field(default_factory=dict)

    @property
    def train_bytes(self) -> int:
        """UTF-8 size of the training files (what the cap applies to)."""
        return sum(len(t.encode("utf-8")) for t in self.train.values())


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python stdlib."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(
    root: Path | None = None, max_bytes: int = MAX_CORPUS_BYTES, seed: int = 0
) -> Corpus:
    """Collect stdlib ``.py`` files in sorted order, skipping tests and odd files.

    Tests, IDLE and lib2to3 are skipped because they are large, repetitive and not
    the style of code users ask for. The file order is shuffled with ``seed`` before
    capping so the cap does not always drop the same (alphabetically late) packages.
    """
    root = root or stdlib_root()
    corpus = Corpus()
    candidates: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        key = rel.as_posix()
        if key in HELD_OUT_FILES:
            corpus.held_out[key] = text
        else:
            candidates.append((key, text))
    random.Random(seed).shuffle(candidates)
    total = 0
    for key, text in candidates:
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            continue
        corpus.train[key] = text
        total += size
    corpus.train = dict(sorted(corpus.train.items()))
    return corpus


# ------------------------------------------------------------------------ tokenizer


def _write_json(path: Path, obj: Any) -> None:
    """Stable JSON formatting so a rebuild produces reviewable diffs."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tokenizer(texts: Sequence[str], out_dir: Path, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train byte-level BPE with ChatML/FIM specials and save it in HF layout.

    Byte-level BPE with the full 256-byte alphabet round-trips any UTF-8 text,
    which the daemon's streaming detokenizer relies on.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for tid, tok in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(tok) != tid:
            raise RuntimeError(f"special token {tok!r} did not get id {tid}")
    tokenizer.save(str(out_dir / "tokenizer.json"))

    special_entry = {
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TARGET_SHAPE.max_position_embeddings,
        "added_tokens_decoder": {
            str(tid): {"content": tok, **special_entry} for tid, tok in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map: dict[str, Any] = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map)
    return tokenizer


# ------------------------------------------------------------------------- data mix


def _functions_with_docstrings(source: str) -> Iterator[tuple[str, str, str]]:
    """Yield ``(first docstring line, def line, dedented source)`` per documented function."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        first = doc.strip().splitlines()[0].strip()
        if len(first) < 8:
            continue
        segment = ast.get_source_segment(source, node, padded=True)
        if not segment or len(segment) > 2500:
            continue
        code = textwrap.dedent(segment).rstrip() + "\n"
        yield first, code.splitlines()[0], code


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Encode plain text (no specials inserted, ids only)."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _chat_ids(tokenizer: Tokenizer, user: str, assistant: str) -> list[int]:
    """Token ids of one ChatML exchange, identical to rendering ``CHAT_TEMPLATE``."""
    newline = _encode(tokenizer, "\n")
    return [
        IM_START,
        *_encode(tokenizer, f"user\n{user}"),
        IM_END,
        *newline,
        IM_START,
        *_encode(tokenizer, f"assistant\n{assistant}"),
        IM_END,
        *newline,
        EOT,
    ]


def _fim_ids(tokenizer: Tokenizer, text: str, rng: random.Random) -> list[int]:
    """One PSM fill-in-the-middle example from a ~256-token chunk of ``text``.

    Chunks are short so prefix, suffix and middle usually fall into one training
    window and the model actually learns to use the suffix.
    """
    lines = text.splitlines(keepends=True)
    start = rng.randrange(len(lines))
    chunk = ""
    target_len = rng.randint(300, 900)
    for line in lines[start:]:
        chunk += line
        if len(chunk) >= target_len:
            break
    if len(chunk) < 20:
        chunk = text[:target_len]
    a = rng.randrange(len(chunk))
    b = min(len(chunk), a + rng.randint(1, max(2, len(chunk) // 3)))
    prefix, middle, suffix = chunk[:a], chunk[a:b], chunk[b:]
    return [
        FIM_PREFIX,
        *_encode(tokenizer, prefix),
        FIM_SUFFIX,
        *_encode(tokenizer, suffix),
        FIM_MIDDLE,
        *_encode(tokenizer, middle),
        EOT,
    ]


@dataclass
class MixStats:
    """Token counts per example kind, reported in TRAINING.md."""

    plain_docs: int = 0
    plain_tokens: int = 0
    fim_docs: int = 0
    fim_tokens: int = 0
    chat_docs: int = 0
    chat_tokens: int = 0


def build_mix(
    tokenizer: Tokenizer, files: dict[str, str], seed: int
) -> tuple[np.ndarray, MixStats]:
    """Token stream: plain files (~70%), FIM (~15%) and ChatML function requests (~15%).

    Shares are by token count. Examples are shuffled with ``seed`` and concatenated;
    training windows are cut from this stream at random offsets.
    """
    rng = random.Random(seed)
    stats = MixStats()
    names = sorted(files)
    docs: list[list[int]] = []
    encodings = tokenizer.encode_batch([files[n] for n in names], add_special_tokens=False)
    for enc in encodings:
        ids = [*enc.ids, EOT]
        docs.append(ids)
        stats.plain_docs += 1
        stats.plain_tokens += len(ids)
    plain_share = 1.0 - FIM_SHARE - CHAT_SHARE
    chat_budget = int(stats.plain_tokens * CHAT_SHARE / plain_share)
    fim_budget = int(stats.plain_tokens * FIM_SHARE / plain_share)

    functions = [f for n in names for f in _functions_with_docstrings(files[n])]
    rng.shuffle(functions)
    for first, signature, code in functions:
        if stats.chat_tokens >= chat_budget:
            break
        user = signature if rng.random() < SIGNATURE_PROMPT_SHARE else CHAT_PROMPT_PREFIX + first
        ids = _chat_ids(tokenizer, user, code)
        docs.append(ids)
        stats.chat_docs += 1
        stats.chat_tokens += len(ids)

    while stats.fim_tokens < fim_budget:
        ids = _fim_ids(tokenizer, files[rng.choice(names)], rng)
        docs.append(ids)
        stats.fim_docs += 1
        stats.fim_tokens += len(ids)

    rng.shuffle(docs)
    stream = np.fromiter((t for d in docs for t in d), dtype=np.uint16)
    return stream, stats


# --------------------------------------------------------------------------- models


def model_args(shape: ModelShape, vocab_size: int) -> ModelArgs:
    """mlx-lm Llama args for ``shape``; tied embeddings keep the files small."""
    return ModelArgs(
        model_type="llama",
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        rms_norm_eps=shape.rms_norm_eps,
        vocab_size=vocab_size,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        num_key_value_heads=shape.num_key_value_heads,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=True,
    )


def _flat_params(model: nn.Module) -> dict[str, mx.array]:
    """Dotted-name -> array map; these names are exactly what ``mlx_lm.load`` expects."""
    flat = tree_flatten(model.parameters(), destination={})
    assert isinstance(flat, dict)
    return {str(k): v for k, v in flat.items() if isinstance(v, mx.array)}


def count_params(model: nn.Module) -> int:
    """Number of scalars in ``model`` (tied head counted once)."""
    return sum(int(v.size) for v in _flat_params(model).values())


def save_model(
    model: Model, shape: ModelShape, vocab_size: int, out_dir: Path, tok_dir: Path
) -> None:
    """Write ``model`` in Hugging Face layout (float16) so ``mlx_lm.load`` reads it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in _flat_params(model).items()}
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "intermediate_size": shape.intermediate_size,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_IDS,
        "pad_token_id": EOT,
        "torch_dtype": "float16",
    }
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": None, "eos_token_id": EOS_TOKEN_IDS, "pad_token_id": EOT},
    )
    for name in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, out_dir / name)


# ------------------------------------------------------------------------- training


class Pair(nn.Module):
    """Target and draft in one module so one optimizer step updates both."""

    def __init__(self, target: Model, draft: Model) -> None:
        super().__init__()
        self.target = target
        self.draft = draft


def _log_softmax(logits: mx.array) -> mx.array:
    """Numerically stable log-probabilities over the vocabulary axis."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def pair_loss(
    pair: Pair, x: mx.array, y: mx.array
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Target CE plus draft ``0.5*CE + 0.5*KL(target || draft)``.

    The KL term pulls the draft toward the target's whole distribution (not just
    the data), which is what raises speculative acceptance; the target's logits
    are stop-gradient so the draft cannot drag the target toward itself.
    """
    t_logp = _log_softmax(pair.target(x).astype(mx.float32))
    d_logp = _log_softmax(pair.draft(x).astype(mx.float32))
    yi = y[..., None]
    t_ce = -mx.take_along_axis(t_logp, yi, axis=-1).mean()
    d_ce = -mx.take_along_axis(d_logp, yi, axis=-1).mean()
    t_sg = mx.stop_gradient(t_logp)
    kl = (mx.exp(t_sg) * (t_sg - d_logp)).sum(axis=-1).mean()
    total = t_ce + 0.5 * d_ce + 0.5 * kl
    return total, t_ce, d_ce, kl


@dataclass
class TrainResult:
    """What the run did, for TRAINING.md / train_log.json."""

    steps: int
    tokens_seen: int
    train_seconds: float
    batch_size: int
    seq_len: int
    peak_lr: float
    history: list[dict[str, float]]
    final: dict[str, float]


def _lr_at(step: int, progress: float, warmup: int, peak: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10% of peak by ``progress`` 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, max(0.0, progress))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def train(
    pair: Pair,
    stream: np.ndarray,
    *,
    seconds: float,
    seed: int,
    batch_size: int = 8,
    seq_len: int = SEQ_LEN,
    peak_lr: float = 3e-3,
    warmup: int = 60,
    max_steps: int | None = None,
    log_every: int = 20,
) -> TrainResult:
    """Train both models on shared random windows until the wall-clock budget is spent.

    The cosine schedule runs on the fraction of the time budget used (or of
    ``max_steps``, whichever is further), not on a step count guessed up front:
    on a shared CPU the step rate drifts, and a guessed count either stops early
    or leaves the LR high when time runs out.
    """
    rng = np.random.default_rng(seed)
    optimizer = optim.AdamW(learning_rate=peak_lr, betas=[0.9, 0.95], weight_decay=0.05)
    loss_and_grad = nn.value_and_grad(pair, pair_loss)
    state = [pair.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x: mx.array, y: mx.array) -> tuple[mx.array, ...]:
        (total, t_ce, d_ce, kl), grads = loss_and_grad(pair, x, y)
        grads, _ = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(pair, grads)
        return total, t_ce, d_ce, kl

    keys = ("loss", "target_ce", "draft_ce", "kl")
    high = len(stream) - seq_len - 1
    offsets = np.arange(seq_len + 1)
    history: list[dict[str, float]] = []
    last: dict[str, float] = {}
    # Running sums stay on the device; reading them only at log steps avoids a
    # host sync per step (which matters on a GPU).
    acc = mx.zeros((len(keys),))
    acc_n = 0
    start = time.perf_counter()
    t_warm = 0.0
    n = 0
    while True:
        elapsed = time.perf_counter() - start
        if n == warmup:
            t_warm = elapsed
        progress = (elapsed - t_warm) / max(1e-6, seconds - t_warm)
        if max_steps is not None:
            progress = max(progress, (n - warmup) / max(1, max_steps - warmup))
            if n >= max_steps:
                break
        if elapsed >= seconds:
            break
        lr = _lr_at(n, progress, warmup, peak_lr)
        optimizer.learning_rate = mx.array(lr)
        starts = rng.integers(0, high, size=batch_size)
        window = mx.array(stream[starts[:, None] + offsets].astype(np.int32))
        out = step(window[:, :-1], window[:, 1:])
        acc = acc + mx.stack(list(out))
        acc_n += 1
        mx.eval(acc, state)
        n += 1
        if n % log_every == 0 or n == 1:
            means = np.array(acc / acc_n, dtype=np.float64)
            last = {k: round(float(v), 4) for k, v in zip(keys, means, strict=True)}
            acc = mx.zeros((len(keys),))
            acc_n = 0
            rec = {"step": float(n), "seconds": round(time.perf_counter() - start, 2)}
            rec.update({"lr": lr, **last})
            history.append(rec)
            print(
                f"[train] step {n:5d} t={rec['seconds']:6.1f}s lr={lr:.2e} "
                f"target_ce={last['target_ce']:.3f} draft_ce={last['draft_ce']:.3f}"
                f" kl={last['kl']:.3f}",
                flush=True,
            )
    train_seconds = time.perf_counter() - start
    if acc_n:
        means = np.array(acc / acc_n, dtype=np.float64)
        last = {k: round(float(v), 4) for k, v in zip(keys, means, strict=True)}
        history.append({"step": float(n), "seconds": round(train_seconds, 2), **last})
    return TrainResult(
        steps=n,
        tokens_seen=n * batch_size * seq_len,
        train_seconds=round(train_seconds, 1),
        batch_size=batch_size,
        seq_len=seq_len,
        peak_lr=peak_lr,
        history=history,
        final=last,
    )


# ------------------------------------------------------------------------ evaluation


def evaluate(
    pair: Pair, tokenizer: Tokenizer, held_out: dict[str, str], seq_len: int = SEQ_LEN
) -> dict[str, float]:
    """Held-out CE for both models and greedy draft acceptance.

    Acceptance = fraction of positions where the draft's argmax equals the
    target's argmax under teacher forcing: a proxy for how many drafted tokens a
    greedy speculative decoder keeps.
    """
    ids: list[int] = []
    for name in sorted(held_out):
        ids += [*_encode(tokenizer, held_out[name]), EOT]
    arr = np.array(ids, dtype=np.int32)
    n_win = max(1, (len(arr) - 1) // seq_len)
    agree = 0
    count = 0
    t_nll = 0.0
    d_nll = 0.0
    for w in range(n_win):
        chunk = arr[w * seq_len : w * seq_len + seq_len + 1]
        if len(chunk) < 2:
            break
        x = mx.array(chunk[None, :-1])
        y = mx.array(chunk[None, 1:])
        t_logp = _log_softmax(pair.target(x).astype(mx.float32))
        d_logp = _log_softmax(pair.draft(x).astype(mx.float32))
        yi = y[..., None]
        t_sum = -mx.take_along_axis(t_logp, yi, axis=-1).sum()
        d_sum = -mx.take_along_axis(d_logp, yi, axis=-1).sum()
        same = (t_logp.argmax(-1) == d_logp.argmax(-1)).sum()
        mx.eval(t_sum, d_sum, same)
        t_nll += float(t_sum)
        d_nll += float(d_sum)
        agree += int(same)
        count += int(y.size)
    return {
        "held_out_tokens": float(count),
        "target_ce": round(t_nll / count, 4),
        "draft_ce": round(d_nll / count, 4),
        "greedy_acceptance": round(agree / count, 4),
    }


def sample_completions(target_dir: Path, draft_dir: Path) -> dict[str, str]:
    """Completions through ``mlx_lm.load`` (the daemon's path), greedy and at temp 0.7."""
    from mlx_lm import generate, load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    loaded = load(str(target_dir))
    model, tok = loaded[0], loaded[1]
    draft = load(str(draft_dir))[0]
    prompt = "def fib(n):"
    out: dict[str, str] = {}
    out["greedy"] = prompt + generate(model, tok, prompt, max_tokens=80)
    mx.random.seed(0)
    out["temp_0.7"] = prompt + generate(
        model, tok, prompt, max_tokens=80, sampler=make_sampler(temp=0.7)
    )
    chat_prompt = tok.apply_chat_template(
        [{"role": "user", "content": CHAT_PROMPT_PREFIX + "Return the n-th Fibonacci number."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out["chat_greedy"] = generate(model, tok, chat_prompt, max_tokens=80)
    accepted = 0
    total = 0
    for resp in stream_generate(
        model, tok, prompt, max_tokens=60, draft_model=draft, num_draft_tokens=3
    ):
        total += 1
        accepted += int(bool(getattr(resp, "from_draft", False)))
    out["speculative_from_draft"] = f"{accepted}/{total} generated tokens came from the draft"
    return out


# ---------------------------------------------------------------------------- report


def _human_bytes(n: int) -> str:
    """Short size string for the report."""
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def write_report(out: Path, info: dict[str, Any], samples: dict[str, str]) -> None:
    """Write TRAINING.md: provenance, numbers and samples, so the weights are auditable."""
    tr = info["train"]
    ev = info["held_out_eval"]
    mix = info["mix"]
    sizes = {
        p.relative_to(out).as_posix(): p.stat().st_size
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }
    total = sum(sizes.values())
    lines = [
        "# Embedded `tiny` pairing",
        "",
        "A from-scratch Llama target/draft pair that ships with mlxd so `mlxd run tiny` works",
        "offline. It is a toy: it writes Python-looking code, not correct code.",
        "Regenerate with `python -m tools.embedded_train --out registry/embedded/tiny"
        f" --minutes {info['minutes']} --seed {info['seed']}"
        f" --batch-size {info['batch_size']} --lr {info['lr']}`.",
        "",
        "## Data",
        "",
        f"- Corpus: {info['corpus_files']} `.py` files ({_human_bytes(info['corpus_bytes'])}) of the"
        f" Python {info['python']} stdlib, skipping {', '.join(sorted(SKIP_DIRS))}, files > 200 KB and",
        "  non-UTF-8 files.",
        f"- Held out (never trained on): {', '.join(info['held_out_files'])}.",
        f"- Tokenizer: byte-level BPE, vocab {info['vocab_size']}, specials"
        f" {', '.join(f'`{t}`={i}' for i, t in enumerate(SPECIAL_TOKENS))}.",
        f"- Mix (tokens): plain files {mix['plain_tokens']:,} ({mix['plain_docs']} docs),"
        f" FIM (PSM) {mix['fim_tokens']:,} ({mix['fim_docs']}),"
        f" ChatML function requests {mix['chat_tokens']:,} ({mix['chat_docs']}).",
        "",
        "## Models",
        "",
        "| | hidden | layers | heads (kv) | intermediate | params | file |",
        "|---|---|---|---|---|---|---|",
    ]
    for role in ("target", "draft"):
        s = info["shapes"][role]
        lines.append(
            f"| {role} | {s['hidden_size']} | {s['num_hidden_layers']} |"
            f" {s['num_attention_heads']} ({s['num_key_value_heads']}) | {s['intermediate_size']} |"
            f" {info['params'][role]:,} | {_human_bytes(sizes[f'{role}/model.safetensors'])} |"
        )
    lines += [
        "",
        "## Training",
        "",
        f"- {tr['steps']} steps x batch {tr['batch_size']} x seq {tr['seq_len']}"
        f" = {tr['tokens_seen']:,} tokens in {tr['train_seconds']} s"
        f" (AdamW, peak LR {tr['peak_lr']}, warmup + cosine, float32, saved as float16).",
        f"- Machine: {info['machine']}.",
        "- Draft loss: 0.5 CE + 0.5 KL(target || draft) on the target's stop-gradient logits.",
        f"- Final train loss (mean of the last logged steps): target CE {tr['final'].get('target_ce')},"
        f" draft CE {tr['final'].get('draft_ce')}, KL {tr['final'].get('kl')}.",
        f"- Held-out ({int(ev['held_out_tokens']):,} tokens): target CE {ev['target_ce']},"
        f" draft CE {ev['draft_ce']}, greedy draft acceptance {ev['greedy_acceptance']:.1%}.",
        f"- {samples.get('speculative_from_draft', '')} (speculative decoding, 3 draft tokens).",
        f"- Total size of this folder: {_human_bytes(total)}. Loss history: `train_log.json`.",
        "",
        "## Samples (`mlx_lm.load` on `target/`, prompt `def fib(n):`)",
        "",
    ]
    for key in ("greedy", "temp_0.7", "chat_greedy"):
        lines += [f"{key}:", "", "```python", samples.get(key, "").rstrip(), "```", ""]
    (out / "TRAINING.md").write_text("\n".join(lines), encoding="utf-8")


# ------------------------------------------------------------------------------ main


def _machine_note() -> str:
    """Where the run happened (speed differs a lot between BLAS backends)."""
    import os
    import platform
    from importlib.metadata import version

    blas = (
        "OpenBLAS via LD_PRELOAD" if "openblas" in os.environ.get("LD_PRELOAD", "") else "default"
    )
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, mlx {version('mlx')}"
        f" on {mx.default_device()}, BLAS: {blas}"
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """CLI flags; ``--max-steps`` exists for quick smoke runs."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--log-every", type=int, default=20, help="steps between loss prints")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Build corpus, tokenizer and mix; train; save both models, log and report."""
    args = _parse_args(argv)
    t0 = time.perf_counter()
    out: Path = args.out
    random.seed(args.seed)
    np.random.seed(args.seed)
    mx.random.seed(args.seed)

    corpus = load_corpus(seed=args.seed)
    print(
        f"[data] {len(corpus.train)} files, {corpus.train_bytes / 1e6:.1f} MB; held out {sorted(corpus.held_out)}",
        flush=True,
    )
    if out.exists():
        shutil.rmtree(out)
    tok_dir = out / ".tokenizer"
    texts = [corpus.train[k] for k in sorted(corpus.train)]
    tokenizer = build_tokenizer(texts, tok_dir)
    vocab_size = int(tokenizer.get_vocab_size())
    stream, mix = build_mix(tokenizer, corpus.train, args.seed)
    print(
        f"[data] vocab {vocab_size}, stream {len(stream):,} tokens, mix {asdict(mix)}", flush=True
    )

    target = Model(model_args(TARGET_SHAPE, vocab_size))
    draft = Model(model_args(DRAFT_SHAPE, vocab_size))
    pair = Pair(target, draft)
    mx.eval(pair.parameters())
    params = {"target": count_params(target), "draft": count_params(draft)}
    print(f"[model] params {params}", flush=True)

    result = train(
        pair,
        stream,
        seconds=args.minutes * 60.0,
        seed=args.seed,
        batch_size=args.batch_size,
        peak_lr=args.lr,
        max_steps=args.max_steps,
        log_every=args.log_every,
    )
    ev = evaluate(pair, tokenizer, corpus.held_out)
    print(f"[eval] {ev}", flush=True)

    for role, model, shape in (("target", target, TARGET_SHAPE), ("draft", draft, DRAFT_SHAPE)):
        save_model(model, shape, vocab_size, out / role, tok_dir)
    shutil.rmtree(tok_dir)

    info: dict[str, Any] = {
        "seed": args.seed,
        "minutes": args.minutes,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "python": ".".join(map(str, sys.version_info[:3])),
        "machine": _machine_note(),
        "corpus_files": len(corpus.train),
        "corpus_bytes": corpus.train_bytes,
        "held_out_files": sorted(corpus.held_out),
        "vocab_size": vocab_size,
        "mix": asdict(mix),
        "shapes": {"target": asdict(TARGET_SHAPE), "draft": asdict(DRAFT_SHAPE)},
        "params": params,
        "train": {k: v for k, v in asdict(result).items() if k != "history"},
        "held_out_eval": ev,
    }
    _write_json(out / "train_log.json", {**info, "history": result.history})
    samples = sample_completions(out / "target", out / "draft")
    for key, text in samples.items():
        print(f"[sample:{key}]\n{text}\n", flush=True)
    info["samples"] = samples
    _write_json(out / "train_log.json", {**info, "history": result.history})
    write_report(out, info, samples)
    print(f"[done] {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
