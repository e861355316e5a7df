"""Every Prometheus metric of the server, in a registry per app (several apps can live in one process)."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server._asgi import HTTPMiddleware
from server.engine import EngineStats

__all__ = [
    "BATCH_BUCKETS", "CONTENT_TYPE", "EXPANSION_BUCKETS", "LATENCY_BUCKETS", "SUGGEST_BUCKETS", "TOKEN_LATENCY_BUCKETS",
    "Metrics", "MetricsMiddleware",
]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds, as Prometheus expects, at millisecond resolution: a tiny model answers in a few ms,
# a long text on the default model in seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Between two tokens of one stream: a tiny model steps in well under a millisecond, the default one in a few.
TOKEN_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# A keyboard suggestion runs on every keystroke and must answer in a few ms: resolve 0.5-10 ms finely.
SUGGEST_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0)
# Branches one suggestion expanded (rows through the model).
EXPANSION_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Rows in one batched model call (text work, or one step of the running generations).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Set (to an empty directory) before the HTTP workers start: prometheus_client then keeps their metrics in files
MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
UNMATCHED = "<unmatched>"  # route label of requests that matched no route (404s, refused bodies)
# The method label: HTTP's methods, and "other" for any a client made up (each would be a label set of its own: a
# client without a key could grow the registry without bound).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})
# The error codes of 429 and 503 answers (server/errors.py): capacity (queue_full, session_store_full, and
# device_out_of_memory: a batch the GPU could not hold), a key over its rate (rate_limited), Redis unreachable
# (session_store_unavailable), a checkpoint without sessions (sessions_unavailable), a dead engine
# (engine_unavailable); and the one 409 a client retries, session_conflict (another replica wrote the session while
# this request worked on it: requests of one session reached two replicas, e.g. without the affinity header).
REFUSAL_REASONS = ("queue_full", "session_store_full", "device_out_of_memory", "rate_limited",
                   "session_store_unavailable", "sessions_unavailable", "engine_unavailable", "session_conflict")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.model = ""  # label value; set once the engine has loaded the checkpoint
        self.kernel = ""  # label value: the kernels' implementation, kernels.kernel_implementation() ("triton" or
        # "reference"; "reference" for a model on the CPU)
        self.precision = ""  # label value: the model work's precision ("float32" or "bfloat16")
        self.kernel_check_failed = False  # the Triton kernels failed their start-up check (server/engine/_loading.py)
        self.requests = Counter("adaptlm_http_requests", "HTTP requests by route and status.",
                                ["model", "method", "route", "status"], registry=self.registry)
        self.latency = Histogram("adaptlm_http_request_duration_seconds",
                                 "Time from request to the end of the response, by route.",
                                 ["model", "method", "route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.refused = Counter("adaptlm_refused_requests", "Requests answered 429 or 503, or 409 session_conflict, "
                               "by the error's code (queue_full, session_store_full and device_out_of_memory: "
                               "capacity; rate_limited: a key over its rate; session_conflict: two replicas worked on "
                               "one session at once).",
                               ["model", "reason"], registry=self.registry)
        self.scored_bytes = Counter("adaptlm_scored_bytes", "Bytes scored by /v1/score.", ["model"],
                                    registry=self.registry)
        # Streams only: a non-streamed answer arrives whole.
        self.time_to_first_token = Histogram("adaptlm_time_to_first_token_seconds",
                                             "Streams: from submission to the model to the first generated token (a "
                                             "byte; a word model's word).",
                                             ["model", "route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram("adaptlm_inter_token_latency_seconds",
                                             "Streams: between two generated tokens (bytes, or a word model's words) "
                                             "of one sequence.",
                                             ["model", "route"], buckets=TOKEN_LATENCY_BUCKETS,
                                             registry=self.registry)
        self.suggest_latency = Histogram("adaptlm_suggest_duration_seconds",
                                         "Keyboard suggestions: from submission to the engine to the answer.",
                                         ["model"], buckets=SUGGEST_BUCKETS, registry=self.registry)
        self.suggest_expansions = Histogram("adaptlm_suggest_expansions",
                                            "Keyboard suggestions: word-completion branches expanded per request.",
                                            ["model"], buckets=EXPANSION_BUCKETS, registry=self.registry)
        # Read from the engine at each scrape, so that they count all work done, cancelled work included.
        self.engine_stats: Callable[[], EngineStats] | None = None  # set once the engine is running
        # an HTTP worker's engine is in another process: its statistics are fetched before each scrape
        self.refresh_engine_stats: Callable[[], Awaitable[None]] | None = None
        self.registry.register(_EngineCollector(self))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(self.model, method, route, str(status)).inc()
        self.latency.labels(self.model, method, route).observe(seconds)

    def observe_refusal(self, reason: str) -> None:
        self.refused.labels(self.model, reason).inc()

    def start_counting_refusals(self) -> None:
        """Every reason at 0 once the model is known: a rate over them is a number, not "no data"."""
        for reason in REFUSAL_REASONS:
            self.refused.labels(self.model, reason)

    def render(self) -> bytes:
        if os.environ.get(MULTIPROCESS_VARIABLE):
            # HTTP workers (`adaptlm serve` with ADAPTLM_WORKERS): each records its requests in a file of the shared
            # directory (prometheus_client's multiprocess mode); one scrape of any worker sums them all, and adds
            # the engine's statistics, which its process keeps
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            registry.register(_EngineCollector(self))
            return generate_latest(registry)
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        if self._metrics.engine_stats is None:
            return
        stats = self._metrics.engine_stats()
        model = [self._metrics.model]
        for name, doc, value in (
            ("adaptlm_prompt_tokens", "Prompt tokens run through the model for generation (bytes; a "
             "word model's words: GET /v1/models tokenizer).",
             stats.prompt_tokens),
            ("adaptlm_generated_tokens", "Tokens generated (bytes; a word model's words), cancelled "
             "generations included.",
             stats.generated_tokens),
            ("adaptlm_cancelled_generations", "Generations stopped early because their client went away.",
             stats.cancelled),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model"])
            counter.add_metric(model, value)
            yield counter
        gauge = GaugeMetricFamily("adaptlm_active_generations", "Generations in progress.", labels=["model"])
        gauge.add_metric(model, stats.active)
        yield gauge
        failed = GaugeMetricFamily("adaptlm_kernel_check_failed", "1 when the Triton kernels gave other outputs than "
                                   "the references on this model and GPU at start (or failed to run): the server "
                                   "serves with the slower references; its log says why. Else 0.", labels=["model"])
        failed.add_metric(model, float(self._metrics.kernel_check_failed))
        yield failed
        labels = ["model", "kernel", "precision"]
        values = [self._metrics.model, self._metrics.kernel, self._metrics.precision]
        batches = HistogramMetricFamily("adaptlm_batch_rows", "Rows (streams) per batched model call: text work "
                                        "(scores, observes), generation steps and keyboard suggestions' steps "
                                        "(all the typists' branches).", labels=[*labels, "work"])
        for work, counts in (("text", stats.batch_rows), ("generate", stats.decode_rows),
                             ("suggest", stats.suggest_rows)):
            batches.add_metric([*values, work], *_buckets(counts))
        yield batches
        for name, doc, value in (
            ("adaptlm_adaptation_updates", "Session weight updates applied (one per segment and learning memory).",
             stats.updates),
            ("adaptlm_nonfinite_resets", "Weight updates refused, or learned weights reset, by the session guards.",
             stats.nonfinite_resets),
            ("adaptlm_cancelled_work", "Scores and session operations dropped because their client went away.",
             stats.cancelled_work),
            ("adaptlm_budget_exceeded", "Work stopped because its request took more engine time than one request may "
             "(ADAPTLM_MAX_REQUEST_ENGINE_S; the request answers 422 engine_budget_exceeded).",
             stats.budget_exceeded),
            ("adaptlm_suggest_cut", "Keyboard suggestions answered inexactly: the time budget stopped the search.",
             stats.suggest_cut),
            ("adaptlm_suggest_device_fallbacks", "Keyboard word searches on the device (ADAPTLM_SUGGEST_ON_DEVICE) "
             "that could not be certified exact (a pool or node table overflowed) and were searched again on the host.",
             stats.suggest_fallbacks),
            ("adaptlm_generation_adaptations_dropped", "Adaptations after a generation (adapt_while_generating) "
             "dropped: other requests (on other servers) changed the session during each of its tries.",
             stats.generation_adaptations_dropped),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, value)
            yield counter
        evictions = CounterMetricFamily("adaptlm_session_evictions", "Sessions evicted, by reason (ttl, lru).",
                                        labels=[*labels, "reason"])
        for reason, count in sorted(stats.evictions.items()):
            evictions.add_metric([*values, reason], count)
        yield evictions
        if stats.slots:  # session slots (ADAPTLM_SESSION_SLOTS): only where the engine keeps them
            observes = CounterMetricFamily("adaptlm_session_slot_observes", "Observes by what the session slots gave "
                                           "them: hit (the slot held the stored record), miss (filled from the "
                                           "record), declined (run without a slot: none free, or tensors the tables "
                                           "do not fit).", labels=[*labels, "outcome"])
            for outcome, field_name in (("hit", "hits"), ("miss", "misses"), ("declined", "declined")):
                observes.add_metric([*values, outcome], stats.slots[field_name])
            yield observes
            slot_evictions = CounterMetricFamily("adaptlm_session_slot_evictions", "Session slots refilled with "
                                                 "another session (least recently used).", labels=labels)
            slot_evictions.add_metric(values, stats.slots["evictions"])
            yield slot_evictions
            for name, doc, value in (
                ("adaptlm_session_slots", "Session slots the engine keeps on the model's device.",
                 stats.slots["capacity"]),
                ("adaptlm_session_slots_used", "Session slots holding a session.", stats.slots["used"]),
            ):
                gauge = GaugeMetricFamily(name, doc, labels=labels)
                gauge.add_metric(values, value)
                yield gauge
        for name, doc, value in (
            ("adaptlm_queue_depth", "Work items waiting to start.", stats.queued),
            ("adaptlm_active_sessions", "Sessions in the store.", stats.sessions),
            ("adaptlm_session_store_bytes", "Bytes the sessions hold: their tensors (memory store), their export blobs "
             "(Redis: the shared store's).", stats.session_bytes),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge


def _buckets(counts: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative histogram buckets and the sum, from exact observation counts (value -> how many times)."""
    buckets = [(str(float(b)), float(sum(c for v, c in counts.items() if v <= b))) for b in BATCH_BUCKETS]
    buckets.append(("+Inf", float(sum(counts.values()))))
    return buckets, float(sum(v * c for v, c in counts.items()))


class MetricsMiddleware(HTTPMiddleware):
    """Counts and times every HTTP request; labels it with the route template, never the raw path."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
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
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.observe_request(method, label, status, time.perf_counter() - start)
