"""Request IDs: every answer carries `X-Request-ID`, and the server's log lines carry the same ID.

A client (or the proxy in front, deploy/nginx) may send its own `X-Request-ID`: it is kept when it is 1-128
characters of letters, digits and `.`, `_`, `:`, `-` (anything else could forge log lines or bloat them), and
replaced by a new random one otherwise. An operator given the ID of a failed call finds its lines in the access log
and in the warnings it caused. Work the engine thread does for many requests at once logs `-`.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import re
import uuid
from contextvars import ContextVar
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import Message, Receive, Scope, Send

from server._asgi import HTTPMiddleware

HEADER = "X-Request-ID"
REQUEST_ID: ContextVar[str] = ContextVar("adaptlm_request_id", default="-")
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


def request_id_for(given: str | None) -> str:
    """The client's ID when it is a safe one, else a new one (32 hex digits)."""
    if given is not None and _VALID.fullmatch(given):
        return given
    return uuid.uuid4().hex


class RequestIdMiddleware(HTTPMiddleware):
    """Outermost: sets the request's ID for everything below it (REQUEST_ID) and adds it to the answer, whoever
    answers (a route, an error handler, a refused body)."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = request_id_for(Headers(scope=scope).get(HEADER))
        token = REQUEST_ID.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = rid
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


# Query parameters whose values are credentials (the keyboard page's `?key=`): an access line prints `key=***`.
_SECRET_PARAM = re.compile(r"(?i)([?&](?:[a-z_.-]*key|[a-z_.-]*token|password|secret)=)[^&#]*")


def redact_query(path: str) -> str:
    """`path` (with its query) with the values of credential parameters replaced by `***`."""
    return _SECRET_PARAM.sub(r"\1***", path)


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` (the current request's, or `-`) for the formats that print it, and keeps
    credentials in a query string (`/keyboard?key=...`) out of uvicorn's access lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        args = record.args
        if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, request_id, and for uvicorn's access
    lines client, method, path, http_version and status as fields of their own; a traceback as `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "-")}
        args = record.args
        if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
            client, method, path, version, status = args
            out |= {"client": client, "method": method, "path": path, "http_version": version, "status": status}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def install(log_format: str = "text") -> None:
    """Print the request ID in the root logger's handlers (the CLI's `basicConfig`), as text (LOG_FORMAT) or as JSON
    lines (`log_format` "json")."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
        handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(LOG_FORMAT))


def uvicorn_log_config(log_format: str = "text") -> dict[str, Any]:
    """uvicorn's own logging configuration, with the request ID in its access lines (and `-` in its others); with
    `log_format` "json", its lines are JSON too."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["request_id"] = {"()": RequestIdFilter}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("request_id")
    config["formatters"]["access"]["fmt"] = \
        '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s [%(request_id)s]'
    if log_format == "json":
        config["formatters"] = {name: {"()": JsonFormatter} for name in config["formatters"]}
    return config
