"""HTTP: the Starlette app, Ollama routes, streaming and error bodies.

May import `engine` and `registry` (never MLX arrays directly).
"""
