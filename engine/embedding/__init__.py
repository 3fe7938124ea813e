"""Embedding models: which models embed (and how they pool), the encoders written on mlx, and
the runner that batches their inputs.

`spec` and `table` are pure Python (they read a model's JSON files only), so the API can ask
whether a model embeds without loading it; the rest may import mlx and mlx-lm.
"""
