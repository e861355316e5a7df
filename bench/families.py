"""The architectures side by side: one row per checkpoint, on one device.

    python -m bench.families [--checkpoints DIR ...] [--text FILE] [--bytes 100000] [--device auto] [--json PATH]

Columns: inference parameters; the checkpoint's size on disk; training minutes and tokens/s (from config.json and
the median of its train.jsonl, measured where it was trained, which the model card names; CPU-minutes for a run on
the "cpu" time clock); the validation bits per byte of its model card (the whole validation file); bits per byte of
the held-out book (static, whole context carried: `evaluate_bpb` with 8 streams), and of 64 pieces of 128 bytes each
scored from a cold start; scoring tokens/s at batch 32; the prompt's time (a 256-byte prompt read and the first byte
generated, batch 1) and generation latency after it (ms a byte: the 63 greedy bytes after that first one); suggestion
latency (ms a `suggest` call on a 256-byte context: word completions and next characters); a session's state in
bytes (`State.row_bytes`: in memory, caches included, and as exports and stores keep it, `State.persistent`) and its
sparse adapter in bytes (float32 k x k at the checkpoint's dyneval.json size).

The default text is the held-out book of the dynamic-evaluation benchmark (chesterton-brown, never trained on).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench._common import family_args, family_text, machine_line, suggest_afresh, word_context
from models.base import LanguageModel
from models.checkpoint import load_checkpoint
from models.device import resolve_device
from models.sampling import SamplingParams, generate
from trainer.train import evaluate_bpb


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_tokens_per_s(path: Path) -> float | None:
    log = path / "train.jsonl"
    if not log.is_file():
        return None
    rates = [r["tokens_per_s"] for line in log.read_text().splitlines() if "tokens_per_s" in (r := json.loads(line))]
    return statistics.median(rates) if rates else None


def cold_bpb(model: LanguageModel, pieces: list[bytes], bos: int) -> float:
    """Bits per byte of `pieces` (of one length), each a new stream as a new session or a stateless /v1/score reads
    it (`score_bytes`): the initial state, the start token `bos` first, every byte of the piece scored. One batch of
    independent rows. (Splitting the joined pieces into rows instead gave each row its first byte as the first
    input, not `bos`, and left that byte unscored.)"""
    rows = torch.tensor([[bos, *piece] for piece in pieces])  # (N, 1 + L)
    return evaluate_bpb(model, rows.flatten(), streams=len(pieces))


def measure(path: Path, text: bytes, device: torch.device) -> dict[str, object]:
    ck = load_checkpoint(path, device=device)
    model = ck.model
    row: dict[str, object] = {"checkpoint": path.name, "arch": ck.config.arch}
    training_only = set(model.training_only_parameters())
    row["params"] = sum(p.numel() for n, p in model.named_parameters() if n not in training_only)
    row["disk_mb"] = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
    row["train_tok_s"] = _train_tokens_per_s(path)
    training = ck.meta.get("training", {})
    row["train_min"] = training["seconds"] / 60 if "seconds" in training else None
    row["valid_bpb"] = ck.meta.get("metrics", {}).get("valid_bpb")  # the card's: whole validation file
    row["bpb"] = evaluate_bpb(model, text, streams=8)
    # cold starts: 64 pieces of 128 bytes from the text, each scored from the initial state (a new session's, a
    # stateless /v1/score's), as one batch of independent streams
    # (every 1,500 bytes, closer on a text under 94,628 bytes, so that each piece is whole)
    stride = min(1500, (len(text) - 128) // 63)
    row["cold_bpb"] = cold_bpb(model, [text[i * stride : i * stride + 128] for i in range(64)], ck.tokenizer.bos)
    data = text[: 32 * 2000]
    evaluate_bpb(model, data[:4000], streams=32)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    evaluate_bpb(model, data, streams=32)
    _sync(device)
    row["score_tok_s"] = len(data) / (time.perf_counter() - t0)
    prompt = text[:256]
    "".join(generate(model, prompt, SamplingParams(max_tokens=8, temperature=0.0)))  # warm-up

    def generate_ms(n: int) -> float:
        """ms of a whole greedy call: the prompt read, then n bytes (median of 3)."""
        times = []
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            "".join(generate(model, prompt, SamplingParams(max_tokens=n, temperature=0.0)))
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    # the prompt apart: an mLSTM reads it byte by byte, a transformer in one pass, so a figure that spread it over
    # the bytes generated compared the prompts more than the generation
    n = 64
    row["prompt_ms"] = generate_ms(1)
    row["gen_ms"] = (generate_ms(n) - row["prompt_ms"]) / (n - 1)
    context = word_context(text, 1000, 1256)
    raw = context.encode()
    state = model.init_state(1)
    times = []
    for _ in range(4):
        _sync(device)
        t0 = time.perf_counter()
        suggest_afresh(model, context, ck.tokenizer)
        _sync(device)
        times.append(time.perf_counter() - t0)
    row["suggest_ms"] = statistics.median(times[1:]) * 1e3
    with torch.no_grad():
        out = model(torch.tensor([list(raw)], device=device), state)
    row["state_bytes"] = out.state.row_bytes
    row["stored_state_bytes"] = out.state.persistent().row_bytes  # what exports and stores keep: no caches
    site = model.adaptation_sites()[0]
    k = site.adapter_size(int(ck.dyneval.get("sparse", {}).get("adapter_units", 0) or 0))
    row["adapter_bytes"] = 4 * k * k * len(model.adaptation_sites())
    return row


def _fmt(v: object, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser()
    family_args(ap)
    ap.add_argument("--bytes", type=int, default=100_000, help="bytes of the text for bits per byte")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    device = resolve_device(args.device)
    text_path = family_text(args)
    text = text_path.read_bytes()[: args.bytes]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_line()
    print(f"# architectures side by side on {device.type} ({where}); text {text_path.name}, "
          f"{len(text):,} bytes")
    print("| checkpoint | arch | parameters | disk MB | train min | train tok/s | valid bits/byte (card) | bits/byte "
          "| cold 128 B bits/byte | score tok/s (32 streams) "
          "| prompt ms (256 B) | generate ms/byte | suggest ms | session state bytes (in memory / stored) "
          "| sparse adapter bytes |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for path in args.checkpoints:
        try:
            r = measure(Path(path), text, device)
        except Exception as e:  # one broken checkpoint must not cost the others' rows (one GPU shot)
            print(f"| {Path(path).name} | error: {type(e).__name__}: {e} |")
            continue
        rows.append(r)
        print(f"| {r['checkpoint']} | {r['arch']} | {r['params']:,} | {r['disk_mb']:.1f} "
              f"| {_fmt(r['train_min'], '.1f')} | {_fmt(r['train_tok_s'], ',.0f')} | {_fmt(r['valid_bpb'], '.4f')} "
              f"| {r['bpb']:.4f} | {r['cold_bpb']:.4f} | {r['score_tok_s']:,.0f} | {r['prompt_ms']:.1f} "
              f"| {r['gen_ms']:.2f} "
              f"| {r['suggest_ms']:.1f} | {r['state_bytes']:,} / {r['stored_state_bytes']:,} "
              f"| {r['adapter_bytes']:,} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
