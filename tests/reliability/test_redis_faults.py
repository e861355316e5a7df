"""A Redis that goes away under a running server (sessions in Redis), then comes back: while it is away, what needs
the store answers 503 in the one error shape with Retry-After (`session_store_unavailable`), nothing else fails,
and work that needs no session goes on; once it is back the same server process serves again, without a restart,
and no session lost or gained an observe that was not acknowledged. The observes go through the SDK, which retries
a 503 as told (`Retry-After`) under the same `Idempotency-Key`: an observe whose write landed in Redis just before it
went away (answered 503) is answered as applied by its retry, and not applied twice.

Two ways to go away: stopped (connections refused; restarted on the same port with its append-only file, so the
sessions are still there), and paused with SIGSTOP (connections accepted, no answer: a hung Redis or a network
partition; the first call to find it so waits out the store's 5 s socket timeout, the next ones fail at once).

Two bugs found here, fixed in server/engine/_redis.py, each with a store-level test below: an observe whose write
timed out (answered 503) was done anyway when the paused Redis resumed; and every call to a hung Redis waited out
its own timeout on the engine's worker thread, which stopped all model work, static scoring too, for the pause."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from adaptlm_client import AdaptlmError, Client, RetryPolicy
from tests.reliability.conftest import RedisProcess, ServerProcess, run_server

TEXT = "The meeting has moved to Thursday afternoon, same room as last week.\n"
ALLOWED = {200, 201, 503}


@dataclass
class Answer:
    at: float  # monotonic, when the answer came
    what: str
    status: int
    response: httpx.Response


class Recording(httpx.HTTPTransport):
    """The SDK's transport, keeping every answer to its requests (its retries included)."""

    def __init__(self, answers: list[Answer]) -> None:
        super().__init__()
        self.answers = answers

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        response.read()
        self.answers.append(Answer(time.monotonic(), "observe", response.status_code, response))
        return response


# Longer than Redis is away in these tests: every observe is answered in the end
RETRY_AS_TOLD = RetryPolicy(max_retries=20, max_delay_s=5.0)


@dataclass
class Worker:
    """One client in a loop over `calls`: observe its session (with the SDK, retrying as told: the loop waits), or
    suggest, read it back and a static score (answered at once, 503 or not); every answer kept."""

    url: str
    session: str | None  # None: static scores only
    calls: tuple[str, ...]
    answers: list[Answer] = field(default_factory=list)
    acknowledged: int = 0  # bytes of the observes the SDK returned (answered 200, maybe after retries)
    unknown: int = 0  # bytes of the observes that raised, and other requests cut off (none expected)

    def observe(self, sdk: Client) -> httpx.Response:
        try:
            sdk.observe(str(self.session), TEXT)
        except AdaptlmError:
            self.unknown += len(TEXT)
        else:
            self.acknowledged += len(TEXT)
        return self.answers[-1].response

    def run(self, stop: threading.Event) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c, \
                Client(self.url, timeout=30, retry=RETRY_AS_TOLD, transport=Recording(self.answers)) as sdk:
            calls: list[tuple[str, Callable[[], httpx.Response]]] = [
                ("observe", lambda: self.observe(sdk)),
                ("suggest", lambda: c.post(f"/v1/sessions/{self.session}/suggest", json={"context": "The mee"})),
                ("get", lambda: c.get(f"/v1/sessions/{self.session}")),
                ("score", lambda: c.post("/v1/score", json={"text": TEXT})),
            ]
            calls = [(what, call) for what, call in calls if what in self.calls]
            while not stop.is_set():
                for what, call in calls:
                    try:
                        r = call()
                    except httpx.TransportError:
                        self.unknown += 1
                        continue
                    if what != "observe":  # the SDK's answers are kept by its transport
                        self.answers.append(Answer(time.monotonic(), what, r.status_code, r))
                    time.sleep(0.02)


def run_load(url: str, sessions: list[str | None]) -> tuple[list[Worker], threading.Event, list[threading.Thread]]:
    """Per session, one worker observing and one reading it (and scoring); per None, a static scorer."""
    workers = [w for sid in sessions for w in (
        [Worker(url, sid, ("observe",)), Worker(url, sid, ("suggest", "get", "score"))] if sid is not None
        else [Worker(url, None, ("score",))])]
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    return workers, stop, threads


def check_answers(answers: list[Answer], assert_error_shape: Callable[..., dict[str, Any]]) -> int:
    """Only 200, 201 and 503; each 503 the store's, in the one shape with Retry-After -> the count of 503s."""
    statuses = {a.status for a in answers}
    assert statuses <= ALLOWED, {s: [a.what for a in answers if a.status == s][:5] for s in statuses - ALLOWED}
    unavailable = [a for a in answers if a.status == 503]
    for a in unavailable:
        assert_error_shape(a.response, 503, "service_unavailable_error", code="session_store_unavailable")
        assert int(a.response.headers["retry-after"]) >= 1
    return len(unavailable)


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess,
                                                                                              RedisProcess]]:
    """One server with its sessions in one durable Redis for the tests that take that Redis away: each gives it
    back, and the same process serving on after the Redis came back (without a restart) is what they test."""
    folder = tmp_path_factory.mktemp("redis-faults")
    store = RedisProcess(folder, durable=True)
    store.start()
    try:
        with run_server(tiny_checkpoint, folder / "server.log", {"ADAPTLM_SESSION_STORE": store.url}) as server:
            yield server, store
    finally:
        store.stop()


@pytest.fixture
def server_and_store(served: tuple[ServerProcess, RedisProcess]) -> tuple[ServerProcess, RedisProcess]:
    """The module's server and Redis, the Redis running and answering (whatever an earlier test left)."""
    server, store = served
    assert store.process is not None
    if store.process.poll() is None:
        store.resume()
    else:
        store.start()
    assert server.process.poll() is None, server.tail()
    return server, store


def end_load(stop: threading.Event, threads: list[threading.Thread], workers: list[Worker],
             assert_error_shape: Callable[..., dict[str, Any]], timeout_s: float) -> tuple[list[Answer], int]:
    """Stop `run_load`'s workers -> every answer, and the count of 503s (`check_answers`)."""
    stop.set()
    for t in threads:
        t.join(timeout_s)
    answers = [a for w in workers for a in w.answers]
    return answers, check_answers(answers, assert_error_shape)


def assert_acknowledged(c: httpx.Client, workers: list[Worker]) -> None:
    """No observe applied that was not acknowledged, none twice, none acknowledged lost: each session holds exactly
    the bytes of its worker's acknowledged observes (every answer known)."""
    for w in workers:
        assert w.unknown == 0
        if "observe" in w.calls:
            assert c.get(f"/v1/sessions/{w.session}").json()["stats"]["bytes_observed"] == w.acknowledged


def recovered_at(answers: list[Answer], since: float) -> float:
    """Seconds from `since` to the first answer after which no session request failed."""
    failures = [a.at for a in answers if a.at >= since and a.status not in (200, 201)]
    return (max(failures) if failures else since) - since


def test_redis_paused_mid_run(server_and_store: tuple[ServerProcess, RedisProcess],
                              assert_error_shape: Callable[..., dict[str, Any]]) -> None:
    server, store = server_and_store
    with httpx.Client(base_url=server.url, timeout=60) as c:
        sessions: list[str | None] = [c.post("/v1/sessions", json={}).json()["id"] for _ in range(2)]
        workers, stop, threads = run_load(server.url, [*sessions, None])  # and a static scorer
        time.sleep(1.0)
        paused = time.monotonic()
        store.pause()
        time.sleep(8.0)  # past the store's 5 s socket timeout
        store.resume()
        up = time.monotonic()
        time.sleep(3.0)
        answers, unavailable = end_load(stop, threads, workers, assert_error_shape, 60)
        # The first call to find Redis hung waits out the 5 s timeout; from then on the store knows it cannot be
        # reached: session requests answer 503 at once, and work that needs no session goes on.
        late = [a for a in answers if paused + 6.0 < a.at < up]
        assert sum(a.status == 503 for a in late) >= 3, [(a.what, a.status) for a in late]
        assert sum(a.what == "score" and a.status == 200 for a in late) >= 3, [(a.what, a.status) for a in late]
        recovery = recovered_at(answers, up)
        assert recovery < 6.0, recovery  # a call sent just before the resume may still time out
        assert server.process.poll() is None and c.get("/readyz").status_code == 200
        assert sum(a.at > up + recovery and a.what == "observe" and a.status == 200 for a in answers) >= 2
        assert_acknowledged(c, workers)
        static = [a.at for a in workers[-1].answers]
        gap = max(b - a for a, b in zip(static, static[1:], strict=False))
    print(f"redis paused 8 s: {len(answers)} answers, {unavailable} 503s, all answered again {recovery:.2f} s "
          f"after it resumed; {sum(paused < t < up for t in static)} static scores answered during the pause, "
          f"the longest wait between two {gap:.1f} s")


@pytest.mark.alone  # a bound on wall-clock time (recovery < 2 s), and Redis stopped at a time against the load
def test_redis_stopped_and_restarted_mid_run(server_and_store: tuple[ServerProcess, RedisProcess],
                                             assert_error_shape: Callable[..., dict[str, Any]]) -> None:
    server, store = server_and_store
    with httpx.Client(base_url=server.url, timeout=30) as c:
        sessions = [c.post("/v1/sessions", json={}).json()["id"] for _ in range(3)]
        workers, stop, threads = run_load(server.url, sessions)
        time.sleep(1.5)
        down = time.monotonic()
        store.stop()
        time.sleep(2.5)
        answers_down = [a for w in workers for a in w.answers if a.at > down + 0.5]
        store.start()  # the same port, its append-only file: the sessions as they were
        up = time.monotonic()
        time.sleep(4.0)
        answers, unavailable = end_load(stop, threads, workers, assert_error_shape, 30)
        # while it was down: the session routes answered 503, static scoring went on
        assert {a.what for a in answers_down if a.status == 503} >= {"observe", "suggest", "get"}
        assert [a.status for a in answers_down if a.what == "score"] and all(
            a.status == 200 for a in answers_down if a.what == "score")
        # back without a restart of the server: the last seconds are all answered, by the same process
        recovery = recovered_at(answers, up)
        assert recovery < 2.0, recovery
        assert server.process.poll() is None and c.get("/readyz").status_code == 200
        assert sum(a.at > up + recovery and a.what == "observe" for a in answers) >= 3
        assert_acknowledged(c, workers)
    replayed = sum(a.response.headers.get("idempotent-replayed") == "true" for a in answers)
    print(f"redis stopped 2.5 s: {len(answers)} answers, {unavailable} 503s, all answered again "
          f"{recovery:.2f} s after it restarted; {replayed} observes answered by their earlier write")


def reachable_again(call: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    """`call()` once the store answers again (it fails at once until its background ping reaches Redis)."""
    from server.engine import SessionStoreUnavailable

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except SessionStoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.alone  # a bound on wall-clock time
def test_an_unreachable_redis_fails_fast_until_it_answers(redis_process: Callable[..., RedisProcess]) -> None:
    """Once a call has found Redis hung (its timeout), the next ones fail at once instead of each waiting out its
    own timeout on the engine's worker thread (found by the paused test above: static scoring stopped for the whole
    pause); a background ping notices when Redis answers again."""
    from server.engine import RedisSessionStore, SessionStoreUnavailable
    from tests.server._stores import SESSIONS
    from tests.server.test_redis_store import HASH, TEMPLATE, make

    redis_server = redis_process()
    store = RedisSessionStore(redis_server.url, max_sessions=10, max_bytes=10**9, timeout_s=1.0)
    store.bind(HASH, TEMPLATE, SESSIONS)
    try:
        store.insert(make("a"))
        redis_server.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(SessionStoreUnavailable):
                store.get("a", None)
            assert time.monotonic() - t0 >= 0.9  # the first waits for its timeout
            t0 = time.monotonic()
            for _ in range(5):
                with pytest.raises(SessionStoreUnavailable):
                    store.get("a", None)
            assert store.sweep() == 0
            assert time.monotonic() - t0 < 0.2
        finally:
            redis_server.resume()
        assert reachable_again(lambda: store.get("a", None)) is not None
    finally:
        store.close()


def test_a_write_that_timed_out_is_not_done_later(redis_process: Callable[..., RedisProcess]) -> None:
    """A paused Redis reads a timed-out write from its socket when it resumes: that write must not be done then,
    since its caller was answered 503 (nothing done; clients retry it). Found by the paused test above: an observe
    answered 503 was in the session after the resume."""
    import dataclasses

    from server.engine import RedisSessionStore, SessionStats, SessionStoreUnavailable
    from tests.server._stores import SESSIONS
    from tests.server.test_redis_store import HASH, TEMPLATE, make, same

    redis_server = redis_process()
    store = RedisSessionStore(redis_server.url, max_sessions=10, max_bytes=10**9, timeout_s=0.5)
    store.bind(HASH, TEMPLATE, SESSIONS)
    try:
        # written once, so the script is loaded: the write below is one EVALSHA that Redis can run
        before = store.update(store.insert(make("a", seed=1)))
        assert before is not None
        after = dataclasses.replace(before, stats=SessionStats(bytes_observed=99, updates=5, bits=1.0,
                                                               static_bits=2.0))
        redis_server.pause()
        try:
            with pytest.raises(SessionStoreUnavailable):
                store.update(after)
            time.sleep(0.5)
        finally:
            redis_server.resume()
        got = reachable_again(lambda: store.get("a", None, touch=False))
        assert got is not None and same(got, before), got and got.stats
        assert store.update(after) and store.get("a", None, touch=False).stats == after.stats  # type: ignore[union-attr]
    finally:
        store.close()
