"""Decoder embedding models (Qwen3-Embedding) through mlx-lm's own architectures.

Only the inner transformer is kept (`Model.model`: the final-normed hidden states), so an
untied LM head is never allocated. Inputs are right-padded: under the causal mask a real token
never attends to the pads after it, so the last real token's state is the unpadded one.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes


class DecoderModel(nn.Module):
    """Hidden states, (B, L, hidden), of an mlx-lm decoder's inner model."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        model_class, args_class = _get_classes(config=cfg)
        # mlx arrays are lazy: the untied head built here is dropped before it is ever made
        self.model = model_class(args_class.from_dict(cfg)).model

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        out: mx.array = self.model(ids)
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoints saved from the bare transformer (`layers.0...`, as Qwen3-Embedding's
        are) get the `model.` prefix mlx-lm names them by; the LM head is dropped."""
        named = {
            (k if k.startswith(("model.", "lm_head.")) else "model." + k): v
            for k, v in weights.items()
        }
        return {
            k: v
            for k, v in named.items()
            if k.startswith("model.") and "rotary_emb.inv_freq" not in k
        }
