"""Errors in OpenAI's JSON shape, and the handlers that make sure no traceback reaches a client.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "voice", "code": "voice_not_found"}}
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 409: "invalid_request_error", 411: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "server_error", 504: "server_error"}


class APIError(Exception):
    """An error a client should see: HTTP status + OpenAI error fields (+ extra headers)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def install_handlers(app) -> None:
    """Every error leaves as OpenAI error JSON; unexpected ones are logged and answered with a 500."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def respond(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return respond(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [x for x in first.get("loc", ()) if isinstance(x, str) and x not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        return respond(APIError(400, f"{param}: {message}" if param else message, param, "invalid_value"))

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return respond(APIError(err.status_code, str(err.detail), None, code, dict(err.headers or {})))

    @app.exception_handler(Exception)
    async def unexpected(request, err: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(APIError(500, "internal server error (details are in the server log)", None,
                                "internal_error", type="server_error"))
