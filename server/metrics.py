"""Every Prometheus metric of the server, in a registry per app (several apps can live in one process)."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "Metrics", "MetricsMiddleware"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds, as Prometheus expects, at millisecond resolution: a tiny model answers in a few ms,
# a long text on the default model in seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UNMATCHED = "<unmatched>"  # route label of requests that matched no route (404s, refused bodies)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.model = ""  # label value; set once the engine has loaded the checkpoint
        self.requests = Counter("adaptlm_http_requests", "HTTP requests by route and status.",
                                ["model", "method", "route", "status"], registry=self.registry)
        self.latency = Histogram("adaptlm_http_request_duration_seconds",
                                 "Time from request to the end of the response, by route.",
                                 ["model", "method", "route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.scored_bytes = Counter("adaptlm_scored_bytes", "Bytes scored by /v1/score.", ["model"],
                                    registry=self.registry)

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(self.model, method, route, str(status)).inc()
        self.latency.labels(self.model, method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts and times every HTTP request; labels it with the route template, never the raw path."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # The router stores the matched route in the scope it was given (this very dict).
            path = getattr(scope.get("route"), "path", None)
            label = path if isinstance(path, str) else UNMATCHED
            self.metrics.observe_request(scope["method"], label, status, time.perf_counter() - start)
