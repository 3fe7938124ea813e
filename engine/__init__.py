"""How tokens are made: loading pairings, sampling, drafting, verification, detokenizing and the
per-pairing generation loop.

May import mlx, mlx-lm and `registry`; never Starlette or `api`. Importing it changes nothing in
the process: `backend.configure_backend` makes the machine-wide choices, once, at startup.
"""
