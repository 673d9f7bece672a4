"""Exception classes that vLLM's API server maps to HTTP status codes (400, 403, 503); offline they are
plain `ValueError` / `PermissionError` subclasses."""

from __future__ import annotations

import functools
from typing import Any, cast


@functools.cache
def validation_error_cls() -> Any:
    """A `ValueError` that vLLM's API server also maps to HTTP 400 (a plain ValueError raised while
    adding a request becomes a 500 with an empty message there)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError

    class LensValidationError(VLLMValidationError, ValueError):
        pass

    return LensValidationError


# The first vLLM release with GracefulHTTPError, whose API server answers the status it carries (on older ones
# the 503 and 403 refusals below are plain ValueError / PermissionError: docs/compatibility.md says what
# a client gets there). tests/core/test_adapter.py fails if the installed vLLM disagrees.
GRACEFUL_SINCE = (0, 29)


def _graceful_error_cls(base: type[Exception], status: str, name: str) -> type[Exception]:
    """A subclass of `base` that vLLM's API server answers with HTTP `status` (its GracefulHTTPError);
    plain `base` where vLLM has none."""
    try:
        from http import HTTPStatus

        from vllm.exceptions import GracefulHTTPError
    except ImportError:
        return base
    code = HTTPStatus[status]

    def __init__(self, message: str) -> None:
        GracefulHTTPError.__init__(self, message, code)

    return type(name, (GracefulHTTPError, base), {"__init__": __init__})


@functools.cache
def forbidden_error_cls() -> type[PermissionError]:
    """A `PermissionError` that vLLM's API server maps to HTTP 403. Before GRACEFUL_SINCE vLLM answers a plain
    PermissionError with a 500: there it is also vLLM's validation error, a 400 naming the refusal."""
    cls = _graceful_error_cls(PermissionError, "FORBIDDEN", "LensForbidden")
    if cls is PermissionError:
        try:
            from vllm.exceptions import VLLMValidationError
        except ImportError:
            return PermissionError
        cls = type("LensForbidden", (VLLMValidationError, PermissionError), {})
    return cast("type[PermissionError]", cls)


@functools.cache
def capacity_error_cls() -> type[ValueError]:
    """A `ValueError` (offline) that vLLM's API server maps to HTTP 503: admission refused for now."""
    return cast("type[ValueError]", _graceful_error_cls(ValueError, "SERVICE_UNAVAILABLE", "LensCapacity"))
