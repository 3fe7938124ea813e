"""Errors on the wire: exception types, the one table that maps them to HTTP statuses, and
Ollama's `{"error": "..."}` body.

A handler never picks a status by reading an exception's text: it raises a type (or an
`ApiError` with the status Ollama uses for that case) and `status_of` looks the type up here.
"""

from __future__ import annotations

import logging

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from mlxd.api.durations import DurationError
from mlxd.api.types import ErrorResponse
from mlxd.engine.embedding.model import EmptyInput, InputTooLong, NotAnEmbeddingModel
from mlxd.engine.manager import NotAGenerativeModel, QueueFull, ServerClosing
from mlxd.engine.options import OptionsError
from mlxd.engine.pairing import ModelNotPulled, ModelUnavailable
from mlxd.engine.prompt import PromptError
from mlxd.registry.names import InvalidModelName
from mlxd.registry.pull import NotPullable, PullNotFound, PullRefused

log = logging.getLogger(__name__)


class ApiError(Exception):
    """Raised anywhere in a handler; becomes `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class InvalidRequest(ValueError):
    """The body is not JSON, is not the request's shape, or holds a value out of range."""


class BodyTooLarge(ValueError):
    """The body is larger than the server accepts (MLXD_MAX_BODY)."""


class GenerationFailed(RuntimeError):
    """The engine reported a failure before the answer's first byte."""


class GenerationRefused(ValueError):
    """The request's own input ended its generation before the answer's first byte (its
    grammar failed): a 400, as the same grammar refused before generating would be."""


# The one table: the most specific class of an exception (along its MRO) decides its status;
# anything not listed is a 500.
STATUS: dict[type[BaseException], int] = {
    InvalidRequest: 400,
    OptionsError: 400,
    DurationError: 400,
    PromptError: 400,
    InvalidModelName: 400,
    BodyTooLarge: 413,
    ModelNotPulled: 404,
    PullNotFound: 404,
    PullRefused: 409,
    NotPullable: 400,
    QueueFull: 503,
    ServerClosing: 503,
    NotAGenerativeModel: 400,
    NotAnEmbeddingModel: 501,
    InputTooLong: 400,
    EmptyInput: 400,
    ModelUnavailable: 500,
    GenerationFailed: 500,
    GenerationRefused: 400,
    # the client left while its body was arriving: nobody reads the answer, and nothing failed
    # (499, nginx's "client closed request"; nothing is logged)
    ClientDisconnect: 499,
}


def status_of(exc: BaseException) -> int:
    if isinstance(exc, ApiError):
        return exc.status
    for kind in type(exc).__mro__:
        status = STATUS.get(kind)
        if status is not None:
            return status
    return 500


def message_of(exc: BaseException) -> str:
    """The text a client sees; always encodable (no lone surrogates)."""
    text = exc.message if isinstance(exc, ApiError) else str(exc)
    text = text or type(exc).__name__
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str) -> Response:
    body = msgspec.json.encode(ErrorResponse(message))
    return Response(body, status_code=status, media_type="application/json")


def log_unexpected(request: Request, exc: BaseException) -> None:
    """Log `exc` with its traceback where it is the server's own fault: a type the table does
    not know (a 500 by default). Those it knows, 5xx included (a model that cannot load, a full
    queue, a model that does not embed), are answers, not faults."""
    if not isinstance(exc, ApiError) and not any(kind in STATUS for kind in type(exc).__mro__):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)


async def error_handler(request: Request, exc: Exception) -> Response:
    """Every exception a route raises, as Ollama's error body with the table's status."""
    log_unexpected(request, exc)
    return error_response(status_of(exc), message_of(exc))
