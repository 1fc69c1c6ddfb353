"""OpenAI's error shape, and the exception that carries one: ``ApiError``."""

from __future__ import annotations

import re

import msgspec
from msgspec import Struct


class ApiError(Exception):
    """An error the client caused or must hear about, with its HTTP status."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             405: "MethodNotAllowed", 408: "RequestTimeout", 413: "RequestTooLarge",
             415: "UnsupportedMediaType", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.error_type = error_type  # None: the status's (vLLM names a few others)

    def response(self) -> ErrorResponse:
        error_type = self.error_type or self.TYPES.get(self.status, "Error")
        return ErrorResponse(ErrorInfo(self.message, error_type, self.param, self.status))


_PATH = re.compile(r"at `\$\.?([^`]*)`|missing required field `([^`]*)`$")
_FIELD = re.compile(r"^([a-z_]+): ")


def bad_request(exc: Exception) -> ApiError:
    """A 400 from a decoding error or a ValueError, with the offending field as ``param``."""
    message = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"Invalid JSON body: {message}")
    match = _PATH.search(message) or _FIELD.search(message)
    param = match and next((g for g in match.groups() if g), None)
    return ApiError(400, message, param or None)


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(Struct):
    error: ErrorInfo
