"""Running the HTTP server: bind check, uvicorn, graceful shutdown on SIGINT/SIGTERM.

Importing this module imports MLX: `mlxd serve` configures the backend (`engine.backend`) first.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from mlxd.api.app import build_app
from mlxd.api.state import ServerState
from mlxd.daemon.config import Settings
from mlxd.daemon.lifecycle import Lifecycle
from mlxd.engine.backend import Backend
from mlxd.engine.distributed.group import RankCache, configure_rank_cache
from mlxd.engine.manager import ModelManager
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.probestore import ProbeStore
from mlxd.engine.prompt import PromptError, check_template
from mlxd.registry.home import mlxd_home
from mlxd.registry.leftovers import sweep_leftovers
from mlxd.registry.live import LiveRegistry
from mlxd.registry.registry import Registry
from mlxd.registry.schema import RegistryError

log = logging.getLogger("mlxd")


class _Server(uvicorn.Server):
    """A signal asks for a graceful shutdown and the process then exits 0; uvicorn would
    re-raise the signal after shutting down, turning a clean stop into status -15. The
    requests in flight end at once with an error (`ServerState.stop_serving`): uvicorn would
    wait for them up to its timeout, then cut their connections."""

    def __init__(self, config: uvicorn.Config, stop_serving: Callable[[], object]) -> None:
        super().__init__(config)
        self.stop_serving = stop_serving

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        self.stop_serving()


def bind(host: str, port: int) -> socket.socket | str:
    """The server's socket, listening from the start (before anything loads; connections wait
    until uvicorn takes them), else the reason it cannot be: of two daemons started at once,
    the second is refused here, not after its startup inside uvicorn (a bound socket does not
    hold the port against another bound with SO_REUSEADDR; a listening one does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return "address already in use"
        return exc.strerror or str(exc)
    return sock


def renderable(registry: Registry) -> Registry:
    """`registry`, unless an entry's template is one mlxd cannot render (a Go template past its
    subset, Jinja that does not parse): then the file is invalid (its line is named), as
    `/api/create` refuses the template, rather than every chat on the model being refused."""
    for entry in registry.entries():
        try:
            check_template(entry.template)
        except PromptError as exc:
            at = f"{entry.source}:{entry.line}" if entry.line else str(entry.source)
            raise RegistryError(f"{at}: entry '{entry.name}': key 'template': {exc}") from None
    return registry


def build_state(settings: Settings, backend: Backend) -> ServerState:
    live = LiveRegistry(lambda: renderable(Registry.from_env(cli_path=settings.registry)))
    registry = live()
    log.info("registry: %d models from %s", len(registry), ", ".join(map(str, registry.paths)))
    swept = sweep_leftovers(mlxd_home())
    if swept:
        log.info("removed %d temporary files left by processes that were killed", swept)
    # Not ensure_home(): a home that cannot be created turns the SSD tier off, not the daemon.
    cache_dir = settings.cache_dir or mlxd_home() / "kvcache"
    prefix = PrefixCache(settings.cache_ram_bytes, cache_dir, settings.cache_ssd_bytes)
    # a distributed target's ranks keep their own shards' blocks, each under this root
    configure_rank_cache(
        RankCache(settings.cache_ram_bytes, settings.cache_ssd_bytes, cache_dir / "distributed")
    )
    manager = ModelManager(
        backend,
        default_keep_alive=settings.keep_alive,
        max_loaded=settings.max_loaded,
        prefix=prefix,
        max_queue=settings.max_queue,
        num_parallel=settings.num_parallel,
        adapter_bytes=settings.adapter_bytes,
        memory_budget=settings.memory_budget,
        stall_limit=settings.runner_stall_s,
        probe_store=ProbeStore.default(),
        lookup=lambda name: live().get(name),
    )
    life = Lifecycle(live, manager)
    return ServerState(
        registry=live,
        manager=manager,
        reload=life.reload,
        registry_errors=live.errors,
        startup=life.startup,
        shutdown=life.shutdown,
        stop_engine=life.stop_serving,
        max_body=settings.max_body,
    )


SWITCH_ENV = "MLXD_SWITCH_INTERVAL_US"


def _switch_interval() -> None:
    """`MLXD_SWITCH_INTERVAL_US`: how long a thread waiting for the GIL lets its holder run on
    (Python's default is 5,000 us). A runner coming back from MLX waits that long at most for
    the event loop's streaming work."""
    raw = os.environ.get(SWITCH_ENV, "").strip()
    if not raw:
        return
    try:
        sys.setswitchinterval(max(1.0, float(raw)) / 1e6)
    except ValueError:
        log.warning("%s=%r is not a number of microseconds; left at the default", SWITCH_ENV, raw)


def serve(settings: Settings, backend: Backend) -> int:
    sock = bind(settings.host, settings.port)
    if isinstance(sock, str):
        print(
            f"Error: listen tcp {settings.host}:{settings.port}: bind: {sock}"
            " (is another mlxd or ollama already running? set MLXD_HOST to use another address)",
            file=sys.stderr,
        )
        return 1
    try:
        state = build_state(settings, backend)
    except RegistryError as exc:
        sock.close()
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    _switch_interval()
    app = build_app(state, bind_host=settings.host)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=10,
        access_log=False,
    )
    server = _Server(config, state.stop_serving)
    log.info("mlxd listening on %s:%d", settings.host, settings.port)
    with sock:
        server.run(sockets=[sock])
    return 0
