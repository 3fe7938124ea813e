"""CORS and Host checks as Ollama applies them (gin-contrib/cors + `allowedHostsMiddleware`).

- Host check (DNS-rebinding protection), only when the server is bound to loopback: the
  `Host` must be a loopback, private or unspecified IP, `localhost`, this machine's hostname,
  or end in `.localhost`, `.local` or `.internal`; anything else is a bare 403.
- CORS: a request without `Origin`, or whose `Origin` is `http(s)://<Host>`, is not
  cross-origin. Otherwise the origin must match an allowed pattern (one `*` wildcard each)
  or the answer is a bare 403; a preflight `OPTIONS` is answered 204 with the allow headers,
  and other requests get `Access-Control-Allow-Origin` echoed on their response.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENV_NAMES = ("MLXD_ORIGINS", "OLLAMA_ORIGINS")

DEFAULT_ORIGINS: tuple[str, ...] = (
    *(
        f"{scheme}://{host}{port}"
        for host in ("localhost", "127.0.0.1", "0.0.0.0")
        for scheme in ("http", "https")
        for port in ("", ":*")
    ),
    "app://*",
    "file://*",
    "tauri://*",
    "vscode-webview://*",
    "vscode-file://*",
)

ALLOW_METHODS = "GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS"
ALLOW_HEADERS = ",".join(
    [
        "Authorization",
        "Content-Type",
        "User-Agent",
        "Accept",
        "X-Requested-With",
        "Openai-Beta",
        *(
            f"X-Stainless-{name}"
            for name in (
                "Arch", "Async", "Custom-Poll-Interval", "Helper-Method", "Lang", "Os",
                "Package-Version", "Poll-Helper", "Retry-Count", "Runtime", "Runtime-Version",
                "Timeout",
            )
        ),
    ]
)  # fmt: skip
MAX_AGE = str(12 * 3600)
_PRIVATE = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal")


def env_origins(environ: Mapping[str, str] = os.environ) -> list[str]:
    """MLXD_ORIGINS, else OLLAMA_ORIGINS: comma-separated, trimmed of spaces and quotes."""
    for name in ENV_NAMES:
        value = (environ.get(name) or "").strip().strip("\"'")
        if value:
            return [o.strip() for o in value.split(",") if o.strip()]
    return []


def is_loopback(host: str) -> bool:
    """Whether a bind address only listens on loopback."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host(host_header: str) -> str:
    """The host part of a `Host` header (Go's SplitHostPort, falling back to the whole)."""
    if host_header.startswith("["):
        end = host_header.find("]")
        return host_header[1:end] if end > 0 else host_header
    if host_header.count(":") == 1:
        return host_header.rsplit(":", 1)[0]
    return host_header


def _origin_matches(origin: str, pattern: str) -> bool:
    if "*" not in pattern:
        return origin == pattern
    prefix, _, suffix = pattern.partition("*")
    if len(origin) < len(prefix) + len(suffix):
        return False
    if not (origin.startswith(prefix) and origin.endswith(suffix)):
        return False
    middle = origin[len(prefix) : len(origin) - len(suffix)]
    # `host:*` stands for a port: digits only, so `localhost:1.evil.com` does not pass
    return middle.isdigit() if prefix.endswith(":") and not suffix and "//" in prefix else True


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...]
    check_host: bool
    hostname: str

    @classmethod
    def build(
        cls, bind_host: str, extra_origins: Iterable[str] = (), hostname: str | None = None
    ) -> CorsPolicy:
        return cls(
            origins=tuple(o.lower() for o in (*extra_origins, *DEFAULT_ORIGINS)),
            check_host=is_loopback(bind_host),
            hostname=(hostname if hostname is not None else socket.gethostname()).lower(),
        )

    @classmethod
    def from_env(
        cls, bind_host: str = "127.0.0.1", environ: Mapping[str, str] = os.environ
    ) -> CorsPolicy:
        return cls.build(bind_host, env_origins(environ))

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.lower()
        return any(_origin_matches(origin, p) for p in self.origins)

    def host_allowed(self, host: str) -> tuple[bool, bool]:
        """(allowed, named): `named` is true for hostnames (not IPs) that pass."""
        if not self.check_host:
            return True, False
        host = split_host(host).lower()
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None:
            ok = ip.is_loopback or ip.is_unspecified or any(ip in net for net in _PRIVATE)
            return ok, False
        named = host in ("", "localhost", self.hostname) or host.endswith(_LOCAL_SUFFIXES)
        return named, named


async def _bare(send: Send, status: int, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-length", b"0"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": b""})


class CorsMiddleware:
    """Pure ASGI: checks `Host` and `Origin` before the app sees the request."""

    def __init__(self, app: ASGIApp, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        preflight = scope["method"] == "OPTIONS"
        allowed, named = self.policy.host_allowed(host)
        if not allowed:
            await _bare(send, 403)
            return
        origin = headers.get("origin")
        if not origin or origin in (f"http://{host}", f"https://{host}"):
            if preflight and named:
                await _bare(send, 204)
            else:
                await self.app(scope, receive, send)
            return
        if not self.policy.origin_allowed(origin):
            await _bare(send, 403)
            return
        vary = b"Origin"
        if preflight:
            await _bare(
                send,
                204,
                [
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"access-control-allow-methods", ALLOW_METHODS.encode()),
                    (b"access-control-allow-headers", ALLOW_HEADERS.encode()),
                    (b"access-control-max-age", MAX_AGE.encode()),
                    (b"vary", vary),
                ],
            )
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                out = MutableHeaders(scope=message)
                out["Access-Control-Allow-Origin"] = origin
                out.add_vary_header("Origin")
            await send(message)

        await self.app(scope, receive, send_with_cors)
