"""Ollama model names: parsing, validation and display.

Clients send names in Ollama's form (``llama3.2``, ``me/m:tag``, ``hf.co/org/repo:Q4``) and
expect the same canonical spelling back, so this mirrors ``ollama:types/model/name.go``:
the same part rules, the same defaults and the same ``DisplayShortest``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TAG",
    "InvalidModelName",
    "ModelName",
    "parse_name",
]

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
HUB_HOSTS = ("hf.co", "huggingface.co")

_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
_MODEL_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")

_HOST_MAX = 350
_PART_MAX = 80


class InvalidModelName(ValueError):
    """A name that Ollama would reject; the API maps it to 400 ``invalid model name``."""

    def __init__(self, name: str = "") -> None:
        super().__init__("invalid model name")
        self.name = name


@dataclass(frozen=True)
class ModelName:
    """A fully qualified model name; every part is filled in (defaults applied)."""

    host: str
    namespace: str
    model: str
    tag: str

    @property
    def display(self) -> str:
        """Ollama's ``DisplayShortest``: the name clients list and send back."""
        if self.host.lower() != DEFAULT_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace.lower() != DEFAULT_NAMESPACE:
            prefix = f"{self.namespace}/"
        else:
            prefix = ""
        return f"{prefix}{self.model}:{self.tag}"

    @property
    def key(self) -> str:
        """Case-folded display name: Ollama matches names case-insensitively."""
        return self.display.lower()

    @property
    def full(self) -> str:
        """The fully qualified ``host/namespace/model:tag`` form (used in some error messages)."""
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    def __str__(self) -> str:
        return self.display


def _valid(pattern: re.Pattern[str], part: str, limit: int) -> bool:
    return 0 < len(part) <= limit and pattern.fullmatch(part) is not None


def parse_name(s: str) -> ModelName:
    """Parse ``[scheme://][host/][namespace/]model[:tag]`` and apply Ollama's defaults.

    Splitting happens from the right, as in Ollama, so a host may carry a port: only a
    ``:`` after the last ``/`` marks the tag. Raises :class:`InvalidModelName`.
    """
    if not isinstance(s, str) or not s:
        raise InvalidModelName(str(s))
    rest = s
    scheme = None
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if not _SCHEME_RE.fullmatch(scheme):
            raise InvalidModelName(s)

    tag = DEFAULT_TAG
    if rest.rfind(":") > rest.rfind("/"):
        rest, tag = rest.rsplit(":", 1)
        if not _valid(_MODEL_RE, tag, _PART_MAX):
            raise InvalidModelName(s)

    parts = rest.split("/")
    if len(parts) > 3 or (scheme is not None and len(parts) != 3):
        # A scheme only makes sense in front of an explicit host.
        raise InvalidModelName(s)
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) == 2:
        namespace, model = parts
    else:
        (model,) = parts

    if not (
        _valid(_HOST_RE, host, _HOST_MAX)
        and _valid(_NAMESPACE_RE, namespace, _PART_MAX)
        and _valid(_MODEL_RE, model, _PART_MAX)
    ):
        raise InvalidModelName(s)
    return ModelName(host=host, namespace=namespace, model=model, tag=tag)


def hub_name(name: ModelName) -> ModelName | None:
    """``org/repo[:tag]`` or ``hf.co/org/repo[:tag]`` as the hub name mlxd registers it under,
    ``hf.co/org/repo:tag``; None for names that cannot be a hub repo (``llama3.2``)."""
    host = name.host.lower()
    if host in HUB_HOSTS or (host == DEFAULT_HOST and name.namespace.lower() != DEFAULT_NAMESPACE):
        return ModelName(host="hf.co", namespace=name.namespace, model=name.model, tag=name.tag)
    return None
