"""Server measurements against a real `adaptlm serve` (a subprocess on a free 127.0.0.1 port):

1. suggest: keyboard-suggestion latency (p50, p99, mean) and requests/s with 1, 10 and 50 typists (each level
   but the largest `--repeats` times: on a shared machine a one-minute p99 moves a lot from run to run). Each typist
   has its own session and types e-mails of the message file a character at a time, asking
   POST /v1/sessions/{id}/suggest {context: the message so far, k: 3} after every keystroke, one request
   outstanding per typist. Typists keep a human pace: a key every `--key-interval-ms` (200 ms: 60 words a
   minute), their phases spread at random; a key whose previous answer is late is sent when the answer
   arrives. `--key-interval-ms 0` is the saturated server (the next key as soon as the answer comes). Sessions
   are fresh unless `--history-bytes N`: each typist's session first observes N characters of other e-mails (so
   its adapter and copy model have something to go on, as a returning user's do).
2. observe: bytes adapted per second by 32 sessions observing distinct 2 KB slices at once, on a server with
   `max_batch=1` and then on one with the default `max_batch` (64). `max_batch` counts rows and an observe takes
   two (the session's, adapted, and its unadapted shadow for the static bits): 64 runs all 32 observes in one
   model call. `--precision float32,bfloat16` repeats the comparison in each. A text item too big for
   `max_batch` still starts alone on an empty batch, so `max_batch=1` runs one observe (2 rows) per call: no
   cross-session batching. The rows per call are read back from /metrics.
3. emails: one session observes the first e-mails of the file one by one (each with its blank-line
   separator): bits per byte under the session before it adapts vs the unadapted model on the same stream
   (observe's static figure), the running gain 1 - session bits / static bits, and a plot of it.
4. mixed: one typist's suggestion latency while `--sessions` sessions observe `--observe-bytes` slices back to
   back (a keystroke can wait for a text step: while someone types the engine keeps them to 32 rows).

    python -m bench.server [--checkpoint DIR] [--only suggest|observe|emails|mixed] [--typists 1,10,50]
                           [--history-bytes N]
                           [--keystrokes 200] [--key-interval-ms 200] [--repeats 1] [--suggest-budget-ms 50]
                           [--sessions 32] [--observe-bytes 2048] [--rounds 1]
                           [--max-batch 1,64] [--precision auto[,float32]] [--max-seconds 1800] [--emails 60]
                           [--plot docs/img/session_gain.png]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from adaptlm_client import AsyncClient, Client
from bench._common import DEFAULT_CHECKPOINT, data_file, machine_line
from models.precision import resolve_precision
from server.launch import serving
from server.protocol import SUGGEST_MAX_CONTEXT, SuggestResponse
from server.settings import Settings

MESSAGES = "messages/enron-farmer-d.first2672.txt"  # the default --messages, in the corpora directory
SEPARATOR = "\n\n"  # e-mails are separated by a blank line


@contextmanager
def serve(checkpoint: str, log: Path, start_timeout: float = 300.0, **settings: object) -> Iterator[str]:
    """`adaptlm serve` on a free loopback port until the block ends -> its URL."""
    env = {"ADAPTLM_LOG_LEVEL": "warning"} | {f"ADAPTLM_{k.upper()}": str(v) for k, v in settings.items()}
    with serving(checkpoint, log, env, start_s=start_timeout, stop_s=60) as served:
        yield served.url


def emails(path: Path) -> list[str]:
    return [mail for mail in path.read_text(encoding="utf-8").split(SEPARATOR) if mail.strip()]


def metric(metrics: str, name: str, labels: str = "") -> float:
    """The value of the sample `name{...}` of a /metrics page whose labels contain `labels` (0 if absent)."""
    found = re.search(rf'^{name}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


async def text_rows(url: str) -> tuple[float, float]:
    """(rows, batched calls) of text work so far, from the `adaptlm_batch_rows` histogram."""
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = (await http.get(f"{url}/metrics")).text
    return (metric(metrics, "adaptlm_batch_rows_sum", 'work="text"'),
            metric(metrics, "adaptlm_batch_rows_count", 'work="text"'))


# -- 1. suggestion latency -------------------------------------------------------------------------------------


async def typist(sdk: AsyncClient, http: httpx.AsyncClient, messages: list[str], keystrokes: int, interval: float,
                 start: asyncio.Barrier, deadline: float, latencies: list[float], seed: int, history: str = "") -> None:
    session = await sdk.create_session()
    for i in range(0, len(history), 4096):  # what this user wrote before (its session adapts, its copy model reads)
        (await http.post(f"/v1/sessions/{session.id}/observe", json={"text": history[i : i + 4096]})).raise_for_status()
    path = f"/v1/sessions/{session.id}/suggest"
    (await http.post(path, json={"context": "", "k": 3})).raise_for_status()  # warm-up: connection, first step
    await start.wait()
    keys = ((message, end) for message in messages for end in range(1, len(message) + 1))
    due = time.monotonic() + interval * np.random.default_rng(seed).random()  # this typist's phase
    for _, (message, end) in zip(range(keystrokes), keys, strict=False):
        if time.monotonic() > deadline:
            break
        if (wait := due - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        due = max(due + interval, time.monotonic())
        t0 = time.perf_counter()
        response = await http.post(path, json={"context": message[:end], "k": 3})
        latencies.append(time.perf_counter() - t0)
        response.raise_for_status()
        SuggestResponse.model_validate_json(response.content)
    await session.delete()


async def suggest_level(url: str, typists: int, messages: list[str], keystrokes: int, interval: float,
                        max_seconds: float, histories: list[str] | None = None) -> tuple[list[float], float]:
    """-> (latency of every timed request in seconds, wall seconds of the timed typing). Typist i's session first
    observes histories[i] (none: a fresh session)."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=typists, max_keepalive_connections=typists)
    # Sessions through the SDK; keystrokes over raw httpx, a kept-alive connection per typist (the limits above).
    async with (AsyncClient(url, timeout=120) as sdk,
                httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http):
        start = asyncio.Barrier(typists + 1)
        deadline = time.monotonic() + max_seconds
        tasks = [asyncio.create_task(typist(sdk, http, messages[i::typists], keystrokes, interval, start, deadline,
                                            latencies, seed=i, history=histories[i] if histories else ""))
                 for i in range(typists)]
        async with asyncio.timeout(max_seconds + 300):  # a typist that failed before the barrier leaves it short
            await start.wait()  # every typist has its session and a warm connection
            t0 = time.perf_counter()
            await asyncio.gather(*tasks)
        return latencies, time.perf_counter() - t0


def bench_suggest(args: argparse.Namespace, log: Path) -> None:
    # A message is an e-mail, cut to what one suggestion takes as context.
    messages = [mail[i:i + SUGGEST_MAX_CONTEXT] for mail in emails(args.messages)
                for i in range(0, len(mail), SUGGEST_MAX_CONTEXT)]
    pace = f"a key every {args.key_interval_ms:g} ms" if args.key_interval_ms > 0 else "saturated (no pause)"
    # a typist's history: e-mails from the far end of the file (not the ones typed), a different slice each
    rest = "\n\n".join(reversed(emails(args.messages)))
    hb = args.history_bytes
    histories = [rest[i * hb : (i + 1) * hb] for i in range(max(args.typists))] if hb > 0 else None
    history = f"each session first observes {hb:,} characters of other e-mails" if hb > 0 else "fresh sessions"
    print(f"\n## suggest latency: k=3, up to {args.keystrokes} keystrokes per typist, {pace}, one request "
          f"outstanding each; server time budget {args.suggest_budget_ms:g} ms; {history}")
    print("| typists | requests | p50 ms | p99 ms | mean ms | requests/s | inexact (budget cut) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with serve(args.checkpoint, log, suggest_budget_ms=args.suggest_budget_ms, precision=args.precision[0]) as url:
        for n in args.typists:
            for _ in range(args.repeats if n < max(args.typists) or len(args.typists) == 1 else 1):
                cut0 = suggest_cut(url)
                latencies, seconds = asyncio.run(suggest_level(url, n, messages, args.keystrokes,
                                                               args.key_interval_ms / 1000, args.max_seconds,
                                                               histories))
                ms = 1000 * np.asarray(latencies)
                p50, p99 = np.percentile(ms, [50, 99])
                cut = (suggest_cut(url) - cut0) / len(ms)
                print(f"| {n} | {len(ms):,} | {p50:.1f} | {p99:.1f} | {ms.mean():.1f} | {len(ms) / seconds:,.1f} | "
                      f"{100 * cut:.1f}% |", flush=True)


def suggest_cut(url: str) -> float:
    """Suggestions the server's time budget cut so far (`adaptlm_suggest_cut_total`)."""
    return metric(httpx.get(f"{url}/metrics").text, "adaptlm_suggest_cut_total")


# -- 2. observe throughput, batched or not ---------------------------------------------------------------------


async def observe_rounds(url: str, texts: list[list[str]], max_seconds: float) -> tuple[int, float, int, float]:
    """Each round, session j observes texts[round][j], all at once -> (bytes, seconds, rounds done, mean rows per
    batched model call)."""
    n = len(texts[0])
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
    async with AsyncClient(url, timeout=3600, transport=transport) as sdk:
        sessions = [await sdk.create_session() for _ in range(n)]
        await asyncio.gather(*(s.observe("Warm-up: a first short text.") for s in sessions))
        rows0, calls0 = await text_rows(url)
        deadline = time.monotonic() + max_seconds
        total, seconds, done = 0, 0.0, 0
        for batch in texts:
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            answers = await asyncio.gather(*(s.observe(text) for s, text in zip(sessions, batch, strict=True)))
            seconds += time.perf_counter() - t0
            total += sum(a.bytes for a in answers)
            done += 1
        rows1, calls1 = await text_rows(url)
        await asyncio.gather(*(s.delete() for s in sessions))
        return total, seconds, done, (rows1 - rows0) / max(calls1 - calls0, 1)


def bench_observe(args: argparse.Namespace, log: Path) -> None:
    corpus = args.messages.read_text(encoding="utf-8")
    size, n = args.observe_bytes, args.sessions
    if args.rounds * n * size > len(corpus):
        raise SystemExit(f"{args.messages} has {len(corpus):,} characters, fewer than rounds x sessions x size")
    texts = [[corpus[(r * n + j) * size:(r * n + j + 1) * size] for j in range(n)] for r in range(args.rounds)]
    print(f"\n## observe throughput: {n} sessions at once, {size:,}-character slices, {args.rounds} round(s)")
    print("| precision | max_batch (rows) | observes per call, at most | mean rows per call | rounds | bytes "
          "| seconds | bytes/s | vs first of its precision |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for precision in args.precision:
        first: float | None = None
        for max_batch in args.max_batch:
            with serve(args.checkpoint, log, max_batch=max_batch, precision=precision) as url:
                total, seconds, done, rows = asyncio.run(observe_rounds(url, texts, args.max_seconds))
            rate = total / seconds
            first = first or rate
            print(f"| {precision} | {max_batch} | {max(1, max_batch // 2)} | {rows:.1f} "
                  f"| {done} | {total:,} | {seconds:.1f} | {rate:,.0f} | {rate / first:.2f}x |", flush=True)


# -- 4. keystrokes while sessions observe -----------------------------------------------------------------------


async def mixed_load(url: str, slices: list[str], messages: list[str], keystrokes: int, interval: float,
                     max_seconds: float) -> tuple[list[float], float, float]:
    """`len(slices)` sessions observe their slices back to back while one typist types -> (the typist's
    latencies in seconds, the bytes of the observes that finished meanwhile, seconds)."""
    n = len(slices)
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=n + 2, max_keepalive_connections=n + 2))
    async with (AsyncClient(url, timeout=3600, transport=transport) as sdk,
                httpx.AsyncClient(base_url=url, timeout=120) as http):
        sessions = [await sdk.create_session() for _ in range(n)]
        stop = asyncio.Event()

        finished: list[tuple[float, int]] = []  # (when, bytes) of each observe answered

        async def observer(session: Any, text: str) -> None:
            while not stop.is_set():
                await session.observe(text)
                finished.append((time.perf_counter(), len(text.encode())))

        typist_session = await sdk.create_session()
        path = f"/v1/sessions/{typist_session.id}/suggest"
        tasks = [asyncio.create_task(observer(s, t)) for s, t in zip(sessions, slices, strict=True)]
        await asyncio.sleep(2)  # the observers' batches are running
        latencies: list[float] = []
        keys = ((m, end) for m in messages for end in range(1, len(m) + 1))
        t0 = time.perf_counter()
        deadline = time.monotonic() + max_seconds
        for _, (message, end) in zip(range(keystrokes), keys, strict=False):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(interval)
            start = time.perf_counter()
            (await http.post(path, json={"context": message[:end], "k": 3})).raise_for_status()
            latencies.append(time.perf_counter() - start)
        t1 = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
        return latencies, sum(n for when, n in finished if t0 <= when <= t1), t1 - t0


def bench_mixed(args: argparse.Namespace, log: Path) -> None:
    corpus = args.messages.read_text(encoding="utf-8")
    n, size = args.sessions, args.observe_bytes
    slices = [corpus[j * size:(j + 1) * size] for j in range(n)]
    messages = [mail[i:i + SUGGEST_MAX_CONTEXT] for mail in emails(args.messages)
                for i in range(0, len(mail), SUGGEST_MAX_CONTEXT)]
    print(f"\n## one typist (a key every {args.key_interval_ms:g} ms after the answer) while {n} sessions observe "
          f"{size:,}-character slices back to back")
    print("| precision | keystrokes | p50 ms | p90 ms | p99 ms | bytes/s adapted meanwhile |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    with serve(args.checkpoint, log, precision=args.precision[0]) as url:
        latencies, observed, seconds = asyncio.run(mixed_load(url, slices, messages, args.keystrokes,
                                                              args.key_interval_ms / 1000, args.max_seconds))
    p50, p90, p99 = np.percentile(1000 * np.asarray(latencies), [50, 90, 99])
    print(f"| {args.precision[0]} | {len(latencies)} | {p50:.1f} | {p90:.1f} | {p99:.1f} "
          f"| {observed / seconds:,.0f} |", flush=True)


# -- 3. gain of a session over the e-mails ---------------------------------------------------------------------


def bench_emails(args: argparse.Namespace, log: Path) -> None:
    mails = emails(args.messages)[:args.emails]
    print(f"\n## session vs static, e-mail by e-mail ({len(mails)} e-mails of {args.messages.name}; "
          "session bpb scored before adapting, static: the unadapted model on the same stream)")
    print("| e-mail | bytes | static bpb | session bpb | running gain |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    gains: list[float] = []
    bits = static = seconds = 0.0
    with serve(args.checkpoint, log, precision=args.precision[0]) as url, Client(url, timeout=3600) as client:
        session = client.create_session()
        deadline = time.monotonic() + args.max_seconds
        for i, mail in enumerate(mails, 1):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            r = session.observe(mail + SEPARATOR)
            seconds += time.perf_counter() - t0
            bits, static = bits + r.bits, static + r.static_bits
            gains.append(1 - bits / static)
            print(f"| {i} | {r.bytes:,} | {r.static_bits_per_byte:.3f} | {r.bits_per_byte:.3f} | {gains[-1]:+.4f} |",
                  flush=True)
        server_gain = session.get().stats.gain_over_static
    if not gains:
        raise SystemExit("no e-mail was observed within --max-seconds")
    print(f"\nrunning gain after the first {min(20, len(gains))} e-mails: {gains[min(20, len(gains)) - 1]:+.4f}")
    print(f"running gain after {len(gains)} e-mails: {gains[-1]:+.4f} (the session's gain_over_static: "
          f"{server_gain:+.4f}); {seconds:.1f} s of observes")
    if args.plot:
        plot_gain(args.plot, gains, f"{Path(args.checkpoint).name}: running gain of a session over static")
        print(f"plot: {args.plot}")


def plot_gain(path: Path, gains: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(1, len(gains) + 1), gains, marker=".")
    ax.axhline(0, color="grey", lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("e-mails observed")
    ax.set_ylabel("1 - session bits / static bits")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--only", choices=["suggest", "observe", "emails", "mixed"])
    ap.add_argument("--messages", type=Path,
                    help=f"e-mails separated by blank lines (default: {MESSAGES} of $ADAPTLM_DATA)")
    ap.add_argument("--typists", type=ints, default=[1, 10, 50], help="concurrency levels of the suggest part")
    ap.add_argument("--keystrokes", type=int, default=200, help="timed keystrokes per typist")
    ap.add_argument("--key-interval-ms", type=float, default=200.0, help="a typist's pace (0: saturate the server)")
    ap.add_argument("--history-bytes", type=int, default=0,
                    help="suggest: characters each typist's session observes before typing (0: fresh sessions)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each suggest level but the largest (a minute's p99 moves with the machine's noise)")
    ap.add_argument("--suggest-budget-ms", type=float, default=Settings.model_fields["suggest_budget_ms"].default,
                    help="the server's ADAPTLM_SUGGEST_BUDGET_MS (0: exact searches, however long)")
    ap.add_argument("--sessions", type=int, default=32, help="sessions observing at once")
    ap.add_argument("--observe-bytes", type=int, default=2048, help="characters per observe")
    ap.add_argument("--rounds", type=int, default=1, help="observes per session, each on a new slice")
    ap.add_argument("--max-batch", type=ints, default=[1, Settings.model_fields["max_batch"].default],
                    help="one server per value, one after the other; the ratio is against the first")
    ap.add_argument("--precision", type=lambda s: s.split(","), default=["auto"],
                    help="the server's ADAPTLM_PRECISION; observe runs each of a comma list, the others the first")
    ap.add_argument("--emails", type=int, default=60)
    ap.add_argument("--plot", type=lambda s: Path(s) if s else None, default=Path("docs/img/session_gain.png"),
                    help="PNG of the running gain ('' for none)")
    ap.add_argument("--max-seconds", type=float, default=1800, help="time bound of each level / server / e-mail run")
    args = ap.parse_args()
    if args.messages is None:
        args.messages = data_file(MESSAGES)
    auto = resolve_precision("auto", torch.device("cpu"))
    print(f"# server, {Path(args.checkpoint).name} over loopback HTTP: {machine_line()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, precision auto = {auto} here")
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        log = Path(tmp) / "server.log"
        for part, run in (("suggest", bench_suggest), ("observe", bench_observe), ("emails", bench_emails),
                          ("mixed", bench_mixed)):
            if args.only in (None, part):
                run(args, log)


if __name__ == "__main__":
    main()
