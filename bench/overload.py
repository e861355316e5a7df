"""A burst the server cannot hold: how soon the requests it refuses get their 429 (issue 36's "a 429 answered in
<= 100 ms p99"), with the HTTP server and the engine in one process and with the engine in its own (ADAPTLM_WORKERS).

`--requests` scoring requests (each a `--text-bytes` slice of a book, each on a connection of its own) are
sent at once to one `adaptlm serve` (default checkpoint, one torch thread, ADAPTLM_MAX_QUEUE as it ships: 256);
those past the engine's queue are refused. Prints, for each setting of workers: how many were answered 200 and 429,
the latency of each (p50, p99, max) from the burst's start, and the whole burst's time.

    python -m bench.overload [--workers 0,2] [--requests 400] [--text-bytes 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from bench._common import DEFAULT_CHECKPOINT, data_file, first_bytes, machine_line, server_on_loopback


async def burst(port: int, texts: list[str]) -> list[tuple[int, float]]:
    """Every request at once, each on its own connection -> (status, seconds from the burst's start). The
    connections are opened and the requests' bytes made before the clock starts, and all are written in one loop:
    the client's own Python (an HTTP client's per-request work) would otherwise be most of what is measured."""
    requests = []
    for text in texts:
        body = json.dumps({"text": text}).encode()
        requests.append(b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in texts]
    await asyncio.sleep(1.0)  # the server has accepted them all (a connection is open here before it is accepted)
    start = time.perf_counter()
    for (_, writer), request in zip(connections, requests, strict=True):
        writer.write(request)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[int, float]:
        status = await reader.readline()  # HTTP/1.1 429 Too Many Requests
        seconds = time.perf_counter() - start
        await reader.read()  # the rest, until the server closes
        writer.close()
        return int(status.split()[1]), seconds

    return list(await asyncio.gather(*(answer(r, w) for r, w in connections)))


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    p50, p99 = np.percentile(values, [50, 99])
    return f"{p50 * 1000:,.0f} / {p99 * 1000:,.0f} / {max(values) * 1000:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--text-bytes", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-queue", type=int, default=256, help="ADAPTLM_MAX_QUEUE")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--file", default="gutenberg/austen-persuasion.txt", help="under the data directory")
    args = ap.parse_args()
    raw = first_bytes(data_file(args.file), args.requests * args.text_bytes).decode("utf-8", errors="ignore")
    texts = [raw[i * args.text_bytes:(i + 1) * args.text_bytes] or "abc" for i in range(args.requests)]
    print(f"# {machine_line()}; adaptlm serve (default checkpoint, one torch thread, max_queue {args.max_queue}) "
          "and the client on the same machine")
    print(f"## {args.requests} scores of {args.text_bytes} bytes sent at once, each on its own connection; "
          f"{args.rounds} round(s) per server; ms from the burst's start")
    print("| ADAPTLM_WORKERS | round | 200 | 429 | other | 429 p50 / p99 / max ms | 200 p50 / p99 / max ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for workers in args.workers:
        settings = {"ADAPTLM_WORKERS": str(workers), "ADAPTLM_RATE_LIMIT_PER_S": "0",
                    "ADAPTLM_MAX_QUEUE": str(args.max_queue)}
        with server_on_loopback(args.checkpoint, settings) as url:
            port = int(url.rsplit(":", 1)[1])
            time.sleep(2.0)  # the workers' start-up done (readyz answers with the first one)
            for r in range(args.rounds):
                answers = asyncio.run(burst(port, texts))
                ok = [t for s, t in answers if s == 200]
                refused = [t for s, t in answers if s == 429]
                other = len(answers) - len(ok) - len(refused)
                print(f"| {workers} | {r + 1} | {len(ok)} | {len(refused)} | {other} | {percentiles(refused)} | "
                      f"{percentiles(ok)} |", flush=True)


if __name__ == "__main__":
    main()
