"""Errors the gateway answers itself, as OpenAI's API shapes them.

Body: ``{"error": {"message", "type", "param", "code"}}``; the HTTP status says the class
(400 a bad request, 404 an unknown model or path, 503 no engine could serve). OpenAI answers an
unknown model with 404, type ``invalid_request_error``, code ``model_not_found``. Errors an
engine answers (vLLM shapes them the same way) are passed through as they are.
"""

from __future__ import annotations

import json


class APIError(Exception):
    """An answer the gateway gives instead of forwarding the request."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        if status is not None:
            self.status = status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def sse(self) -> bytes:
        """The error as a server-sent event, for a stream that already began."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


class BadRequest(APIError):
    status = 400


class ModelNotFound(APIError):
    status = 404

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.",
                         param="model", code="model_not_found")


class NotFound(APIError):
    status = 404


class NoEngine(APIError):
    """Every engine is down, or failed this request, within its deadline."""

    status = 503
    type = "service_unavailable"


class UpstreamFailed(APIError):
    """The engine failed after the stream began: the client gets this as the stream's end."""

    status = 502
    type = "upstream_error"
