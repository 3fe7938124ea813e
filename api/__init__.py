"""HTTP: the Starlette app, Ollama routes, streaming, error bodies and Prometheus metrics.

May import `engine` and `registry` (never MLX arrays directly).
"""
