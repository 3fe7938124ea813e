"""Prometheus metrics at `GET /metrics`, kept off the decode path.

Three kinds of recording, each as cheap as its source allows:
- per HTTP request: one counter increment when the response ends (an ASGI middleware);
- per generation: a few increments and histogram observations from the request's final event
  (the manager's finish observers), none per token;
- everything the daemon already keeps (queue depth, running rows, prefix-cache counters, SSD
  write backlog, lifecycle counts) is read when the endpoint is scraped, by a collector.

Each app owns its own `CollectorRegistry`, so several servers can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxd.api.ollama import ServerState
from mlxd.engine.counts import EVICTION, LOAD, LOAD_FAILURE, RUNNER_RESTART
from mlxd.engine.events import Done, Failed
from mlxd.engine.manager import Resident
from mlxd.engine.memory import arrays_bytes

PREFIX = "mlxd"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
UNMATCHED = "unmatched"  # a path no route serves (kept as one label: paths are unbounded)
CLIENT_GONE = "499"  # the client left before its response ended (nginx's "client closed request")


class GenerationMetrics:
    """What each finished generation adds: time to first token, time per output token, tokens
    in and out, draft tokens proposed and accepted by method, how it ended."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: Iterable[str]) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, list(labels), registry=registry)

        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From the request's arrival to its first token (queueing and loading included).",
            ["model"], buckets=TTFT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Decoding time per output token after the first, one observation per generation.",
            ["model"], buckets=TPOT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of finished generations.", ["model"]
        )
        self.cached_tokens = counter(
            "prompt_cached_tokens", "Prompt tokens restored from the prefix cache.", ["model"]
        )
        self.output_tokens = counter("output_tokens", "Tokens generated.", ["model"])
        self.draft_proposed = counter(
            "draft_tokens_proposed", "Draft tokens proposed for verification.", ["model", "method"]
        )
        self.draft_accepted = counter(
            "draft_tokens_accepted", "Draft tokens the target accepted.", ["model", "method"]
        )
        self.generations = counter(
            "generations", "Finished generations by how they ended (stop, length, error).",
            ["model", "reason"],
        )  # fmt: skip

    def observe(self, model: str, event: Done | Failed) -> None:
        """Record one request's final event (a cancelled request sends none)."""
        if isinstance(event, Failed):
            self.generations.labels(model, "error").inc()
            return
        m = event.metrics
        self.generations.labels(model, event.done_reason).inc()
        self.prompt_tokens.labels(model).inc(m.prompt_eval_count)
        self.cached_tokens.labels(model).inc(event.cached_tokens)
        self.output_tokens.labels(model).inc(m.eval_count)
        if m.eval_count > 0:
            self.ttft.labels(model).observe(max(0, m.total_duration - m.eval_duration) / 1e9)
        if m.eval_count > 1:
            self.tpot.labels(model).observe(m.eval_duration / 1e9 / (m.eval_count - 1))
        spec = event.speculation
        if spec.method != "off":
            self.draft_proposed.labels(model, spec.method).inc(spec.drafted)
            self.draft_accepted.labels(model, spec.method).inc(spec.accepted)


class StateCollector(Collector):
    """Reads the daemon's own state at scrape time: nothing is recorded in advance."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        manager = self.state.manager
        queue = manager.queue
        yield _gauge("queue_depth", "Requests waiting for a model or a row.", queue.count)
        yield _gauge("queue_limit", "Waiting requests allowed before answering 503.", queue.limit)
        shown = manager.shown()
        yield _gauge("models_loaded", "Pairings loaded (or loading).", len(shown))
        rows = GaugeMetricFamily(f"{PREFIX}_rows_running", "Rows being decoded.", labels=["model"])
        for name, total in _per_name((n, m.runner.running_rows) for n, m in shown).items():
            rows.add_metric([name], total)
        yield rows
        yield from _adapters(shown)
        yield _gauge("memory_used_bytes", "Memory held by loaded pairings.", manager.memory_used())
        yield _gauge("memory_budget_bytes", "The memory budget.", manager.budget.bytes)
        yield _gauge("memory_arrays_bytes", "Bytes MLX's arrays hold now.", arrays_bytes())
        yield from self._lifecycle([name for name, _ in shown])
        yield from self._prefix_cache()

    def _lifecycle(self, loaded: list[str]) -> Iterator[Metric]:
        counts = self.state.manager.counts.snapshot()
        docs = {
            LOAD: ("model_loads", "Pairing loads started."),
            LOAD_FAILURE: ("model_load_failures", "Pairing loads that failed."),
            EVICTION: ("model_evictions", "Pairings unloaded to make room for another."),
            RUNNER_RESTART: ("runner_restarts", "Runner threads restarted after dying."),
        }
        for event, (name, doc) in docs.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model"])
            for model in sorted({*counts[event], *loaded}):
                family.add_metric([model], counts[event].get(model, 0))
            yield family

    def _prefix_cache(self) -> Iterator[Metric]:
        prefix = self.state.manager.prefix
        if prefix is None:
            return
        s = prefix.stats
        ssd = prefix.ssd
        yield _counter("prefix_cache_lookups", "Prefix-cache lookups.", s.lookups)
        yield _counter("prefix_cache_lookup_tokens", "Prompt tokens looked up.", s.lookup_tokens)
        yield _counter("prefix_cache_hit_tokens", "Prompt tokens found cached.", s.hit_tokens)
        yield _counter("prefix_cache_inserted_blocks", "Blocks stored.", s.inserted_blocks)
        yield _by_tier(
            CounterMetricFamily(
                f"{PREFIX}_prefix_cache_hit_blocks", "Full blocks found, by tier.", labels=["tier"]
            ),
            s.ram_hit_blocks, s.ssd_hit_blocks,
        )  # fmt: skip
        yield _by_tier(
            CounterMetricFamily(
                f"{PREFIX}_prefix_cache_hit_bytes", "K/V bytes restored, by tier.", labels=["tier"]
            ),
            s.ram_hit_bytes, s.ssd_hit_bytes,
        )  # fmt: skip
        yield _by_tier(
            GaugeMetricFamily(f"{PREFIX}_prefix_cache_bytes", "Bytes held, by tier.", labels=["tier"]),
            prefix.ram.nbytes, ssd.nbytes if ssd is not None else 0,
        )  # fmt: skip
        blocks, nbytes = ssd.backlog() if ssd is not None else (0, 0)
        yield _gauge("prefix_cache_ssd_write_backlog_blocks", "Blocks queued for the SSD.", blocks)
        yield _gauge("prefix_cache_ssd_write_backlog_bytes", "Bytes queued for the SSD.", nbytes)
        dropped = ssd.dropped if ssd is not None else 0
        yield _counter(
            "prefix_cache_ssd_dropped_writes", "Blocks not written: the backlog was full.", dropped
        )


def _per_name(values: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Values summed per name: a copy leaving and a fresh load of new files are shown under
    one."""
    totals: dict[str, int] = {}
    for name, value in values:
        totals[name] = totals.get(name, 0) + value
    return totals


def _adapters(shown: list[tuple[str, Resident]]) -> Iterator[Metric]:
    """Adapters resident on each loaded base, and their bytes."""
    count = GaugeMetricFamily(
        f"{PREFIX}_adapters_mounted", "Adapters resident on a loaded base.", labels=["model"]
    )
    size = GaugeMetricFamily(
        f"{PREFIX}_adapter_bytes", "Bytes of the adapters resident on a base.", labels=["model"]
    )
    mounted = [(n, m.runner.pairing.adapters) for n, m in shown if m.runner.pairing is not None]
    for name, total in _per_name((n, a.count) for n, a in mounted).items():
        count.add_metric([name], total)
    for name, total in _per_name((n, a.resident_bytes) for n, a in mounted).items():
        size.add_metric([name], total)
    yield count
    yield size


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _by_tier(family: CounterMetricFamily | GaugeMetricFamily, ram: float, ssd: float) -> Metric:
    family.add_metric(["ram"], ram)
    family.add_metric(["ssd"], ssd)
    return family


class ServerMetrics:
    """The registry of one app and what records into it."""

    def __init__(self, state: ServerState) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by route template and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.generation = GenerationMetrics(self.registry)
        self.registry.register(StateCollector(state))
        state.manager.finish_observers.append(self.generation.observe)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """Pure ASGI middleware: counts each request once, when its response has ended."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_GONE
        ended = False  # the response's last body part went out

        async def sending(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = str(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
            if not ended:
                status = CLIENT_GONE  # a stream the client left midway: not answered in full
        except BaseException:
            if status == CLIENT_GONE:
                status = "500"  # the server's error handler answers outside this middleware
            raise
        finally:
            route = scope.get("route") or _route_of(scope)
            path = getattr(route, "path", None) or UNMATCHED
            self.metrics.requests.labels(path, status).inc()


def _route_of(scope: Scope) -> BaseRoute | None:
    """The route a request's path names where an answer came before routing (a CORS preflight
    answered by its middleware): counted under that route, not as unmatched."""
    app = scope.get("app")
    for route in getattr(app, "routes", ()):
        if route.matches(scope)[0] != Match.NONE:  # (PARTIAL: the path, another method)
            return route
    return None


def metrics_of(request: Request) -> ServerMetrics:
    metrics: ServerMetrics = request.app.state.metrics
    return metrics


async def scrape(request: Request) -> Response:
    return Response(metrics_of(request).exposition(), media_type=CONTENT_TYPE_LATEST)


def routes() -> list[Route]:
    return [Route("/metrics", scrape, methods=["GET"])]
