"""Scoring throughput of a running server over HTTP: `--streams` clients, each scoring `--text-bytes` slices of a
book back to back on a keep-alive connection of its own, for `--seconds`; prints bytes scored a second (of the
answers 200), requests a second, their p50 / p99 latency and the 429s, for each number of streams.

    python -m bench.serve_load --url http://127.0.0.1:8000 [--streams 32,256,2048] [--seconds 20] [--text-bytes 4096]

The client is plain asyncio on raw sockets (an HTTP library's own Python per request would be the bottleneck at
thousands of streams), several processes of it for many streams (`--processes`, default: one per 256 streams, at
most the CPU count). bench/gpu_serve.sh runs it against a server on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time
from urllib.parse import urlsplit

import numpy as np

from bench._common import data_file, first_bytes, machine_line


async def _stream(host: str, port: int, requests: list[bytes], sizes: list[int], stop_at: float,
                  out: list[tuple[int, int, float]]) -> None:
    """One client: requests in turn on one connection until `stop_at` -> out += (status, bytes, seconds)."""
    reader, writer = await asyncio.open_connection(host, port)
    i = 0
    try:
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            writer.write(requests[i % len(requests)])
            status_line = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            out.append((int(status_line.split()[1]), sizes[i % len(sizes)], time.perf_counter() - start))
            i += 1
    finally:
        writer.close()


def _client(url: str, streams: int, texts: list[str], seconds: float, start_at: float) -> list[tuple[int, int, float]]:
    address = urlsplit(url)
    host, port = address.hostname or "127.0.0.1", address.port or 80
    requests, sizes = [], []
    for text in texts:
        body = json.dumps({"text": text}).encode()
        requests.append(f"POST /v1/score HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        sizes.append(len(text.encode()))

    async def run() -> list[tuple[int, int, float]]:
        out: list[tuple[int, int, float]] = []
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*(_stream(host, port, requests[s::streams] or requests, sizes[s::streams] or sizes,
                                       stop_at, out) for s in range(streams)))
        return out

    return asyncio.run(run())


def measure(url: str, streams: int, texts: list[str], seconds: float, processes: int) -> dict[str, float]:
    processes = max(1, min(processes, streams))
    start_at = time.time() + 1.0 + 0.05 * processes
    shares = [streams // processes + (p < streams % processes) for p in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(_client, [(url, n, texts[p::processes], seconds, start_at)
                                       for p, n in enumerate(shares)])
    answers = [a for part in parts for a in part]
    ok = [a for a in answers if a[0] == 200]
    latency = np.array([a[2] for a in ok]) if ok else np.array([float("nan")])
    return {"bytes_s": sum(a[1] for a in ok) / seconds, "requests_s": len(ok) / seconds,
            "p50_ms": float(np.percentile(latency, 50) * 1000), "p99_ms": float(np.percentile(latency, 99) * 1000),
            "refused": float(sum(a[0] == 429 for a in answers)), "other": float(sum(a[0] not in (200, 429)
                                                                                 for a in answers))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[32, 256, 2048])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--text-bytes", type=int, default=4096)
    ap.add_argument("--processes", type=int, default=0, help="client processes (0: one per 256 streams)")
    ap.add_argument("--file", default="gutenberg/chesterton-brown.txt", help="under the data directory")
    args = ap.parse_args()
    raw = first_bytes(data_file(args.file), 4 << 20).decode("utf-8", errors="ignore")
    texts = [raw[i:i + args.text_bytes] for i in range(0, len(raw) - args.text_bytes, args.text_bytes)][:4096]
    print(f"# {machine_line()}; scoring over HTTP at {args.url}, {args.text_bytes}-byte texts, {args.seconds:g} s "
          "per level")
    print("| streams | bytes/s | requests/s | p50 ms | p99 ms | 429 | other |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for streams in args.streams:
        processes = args.processes or min(os.cpu_count() or 1, -(-streams // 256))
        r = measure(args.url, streams, texts, args.seconds, processes)
        print(f"| {streams} | {r['bytes_s']:,.0f} | {r['requests_s']:,.1f} | {r['p50_ms']:,.0f} | {r['p99_ms']:,.0f} "
              f"| {r['refused']:.0f} | {r['other']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
