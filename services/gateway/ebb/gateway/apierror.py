"""The API's error: its envelope (`{"error": {"message", "type", "param", "code"}}`) with the
status the official client maps to its exceptions; a refusal that asking again cannot change
says `x-should-retry: false`, so that the client does not ask three times."""

from __future__ import annotations

from aiohttp import web


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        retry: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.retry = retry

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {} if self.retry else {"x-should-retry": "false"}
        return web.json_response(body, status=self.status, headers=headers)


def not_found(kind: str, rid: str, param: str = "id") -> ApiError:
    return ApiError(404, f"No such {kind} object: {rid}", param=param, code=None)
