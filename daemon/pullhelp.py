"""What to do when `mlxd pull` (or `mlxd run`'s pull) fails: the daemon's error, then a hint.

The daemon does the downloading, so the hints name the environment of `mlxd serve`; a daemon
that `mlxd` itself started inherits the environment of the command that started it.
"""

from __future__ import annotations

HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("offline mode", "HF_HUB_OFFLINE"),
        "the daemon runs with HF_HUB_OFFLINE set: unset it where `mlxd serve` runs (then"
        " restart it), or put the model in a local directory and set an entry's `target:` to"
        " it in $MLXD_HOME/models.yaml",
    ),
    (
        ("gated", "HTTP 401", "HTTP 403"),
        "the hub wants a token: create one at https://huggingface.co/settings/tokens, accept"
        " the repo's conditions, and set HF_TOKEN where `mlxd serve` runs (then restart it)",
    ),
    (
        ("cannot reach", "HTTP 5", "timed out"),
        "the hub could not be reached: check the network, or set HF_ENDPOINT to a mirror"
        " (e.g. HF_ENDPOINT=https://hf-mirror.com) where `mlxd serve` runs, or download the"
        " model elsewhere and set an entry's `target:` to its local directory in"
        " $MLXD_HOME/models.yaml",
    ),
    (
        ("manifest: adapter",),  # an entry's adapter the hub has not (after the hub's own failures)
        "an adapter the entry names is not there: check its `adapters:` (or `draft_adapters:`)"
        " in models.yaml; an adapter of your own is named by its local directory",
    ),
    (
        ("file does not exist",),
        "no such model: `mlxd list` shows the registered names; any MLX repo on the hub pulls"
        " as org/repo or hf.co/org/repo[:revision]",
    ),
    (
        ("no space left",),
        "the disk is full: free space, or set HF_HUB_CACHE to a larger disk where `mlxd serve`"
        " runs",
    ),
)


def pull_hint(message: str) -> str | None:
    """The advice for a pull that failed with `message`; None when there is none to give."""
    for needles, hint in HINTS:
        if any(n.lower() in message.lower() for n in needles):
            return hint
    return None


def explain(message: str) -> str:
    hint = pull_hint(message)
    return f"{message}\n  hint: {hint}" if hint else message
