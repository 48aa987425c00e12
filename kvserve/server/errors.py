"""The API's errors, as OpenAI's error body: the exception a check raises to refuse a request before
admission, and the messages of a body pydantic refused and of a request aborted after admission."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kvserve.server.async_engine import RequestAborted

NO_TOKENIZER = ("this model was loaded without a tokenizer (--skip-tokenizer-init, or no tokenizer files in its directory): "
                "send prompts as token ids to /v1/completions")  # fmt: skip


class APIError(Exception):
    """A request refused before admission: status, message, the field at fault, error type and reason (the code)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 reason: str = "invalid_request", headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.reason = status, message, param, kind, reason
        self.headers = headers or {}


def error_body(message: str, kind: str, param: str | None, code: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   code: str = "invalid_request") -> JSONResponse:  # fmt: skip
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def aborted_body(exc: RequestAborted) -> dict:
    return error_body(exc.message, "timeout_error" if exc.reason == "timeout" else "server_error", None, exc.reason)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc)
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('msg')}", None
        cause = err.get("ctx", {}).get("error")
        param = param or (loc[0] if loc else getattr(cause, "param", None))
        msg = err.get("msg").removeprefix("Value error, ")
        # a message that already names its field (or one about the whole body) is not prefixed again
        named = not loc or msg.startswith((f"{field} ", f"{loc[-1]} ", f"{loc[0]} "))
        parts.append(msg if named else f"{field}: {msg}")
    return "; ".join(parts) or "invalid request", param
