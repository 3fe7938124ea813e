"""HTTP: the Starlette app, Ollama and OpenAI routes, the wire types, streaming and errors.

`types` holds every request/response shape; `codec` reads bodies (bounded) and decodes and
encodes them; `errors` maps exception types to statuses in one table; `state` and `inference`
are what routes share before the first token; `pump` turns engine events into stream chunks
for `ollama` (/api) and `openai` (/v1) alike; `metrics` serves Prometheus' /metrics.

May import `engine` and `registry` (never MLX arrays directly).
"""
