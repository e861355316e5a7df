"""Where the session's learned gain is lost (issue 34): bits per byte of each system on the five texts of the
dynamic-evaluation table, with and without the copy model, split by position in the text and by kind of byte.

    ADAPTLM_DATA=... python -m bench.adapt_losses [--limit 30000] [--texts book,spanish,emails,code,enwik8]
        [--systems static,session,full,...] [--variant NAME:key=value,...] [--out runs/adapt_losses] [--report]

Systems (each one pass over a text gives its network's bits and, mixed with the copy model after them, its bits with
the copy model: the adaptation learns from the network's own scores, as a served session's does):
- static: the shipped weights;
- session: the sparse adapter M at dyneval.json "session" (the default checkpoint served it before the head memory;
  `VariantStream` with the session settings, which scores exactly as `evaluate_many` in sparse mode);
- full: full dynamic evaluation (dyneval.json "full"); full-head, full-input, full-recurrent: the same with only the
  output layer, only the input side (embedding, W_x, W_mx) or only the recurrent matrices (W_mh, W_m) adapting;
- the variants of `VARIANTS` (models/adaptation/_variants.py): other parts, sizes, rates, segments; `--variant`
  defines more (keys of `VariantConfig`, on top of the session's settings);
- the served systems of `SERVED`: a session as the server runs one (`SessionModel`: its batched step and memories,
  the copy model on) with the memories' settings given, e.g. served-head, the output rows' memory
  (models/adaptation/_head_memory.py) at the settings bench/head_defaults.py chose. Their bits are the served ones
  (with the copy model); the network's own bits are not recorded ("-" in the first table).

Each (system, text) is written to --out as it finishes (per-byte log-probs, CPU seconds, state bytes) and skipped
when already there, so a stopped run resumes; `--report` prints the tables from what is there. Texts are cut to
--limit bytes as `bench.dyneval` cuts them (the first bytes). Time is CPU time of the process (the machine is shared):
the cost columns are ratios to static + copy's time a byte, one stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench._common import DEFAULT_CHECKPOINT, ROOT, data_file, machine_line
from bench.dyneval import TEXTS, copy_config
from models.adaptation import FullStream, VariantConfig, VariantStream
from models.checkpoint import Checkpoint, load_checkpoint
from models.copymodel import CopyModel
from models.memory import state_nbytes
from models.scoring import LN2
from models.session import SessionModel
from trainer.evaluation import config_for

# Variants (keys of VariantConfig over the session's settings). Rates: M's is the session's 1e-4; the output parts'
# start at the full section's eta scale (1e-5..1e-4) times a few, since they are far fewer numbers than the
# whole model and the session decays them to the shipped weights.
VARIANTS: dict[str, dict[str, object]] = {
    "bias": {"bias_lr": 1e-3},  # the session + an adapted output bias
    "out32": {"out_rank": 32, "out_lr": 1e-4},  # + a rank-32 update of the output matrix
    "bias+out32": {"bias_lr": 1e-3, "out_rank": 32, "out_lr": 1e-4},
    "out-only": {"units": 0, "bias_lr": 1e-3, "out_rank": 32, "out_lr": 1e-4},  # the output layer alone, no M
    "k512": {"units": 512},  # a larger adapter (4x the state)
    "k768": {"units": 768},  # the whole site
    "lr2x": {"lr": 2e-4},
    "early": {"early": 3.0, "early_bytes": 3000},  # 4x the rates at the start, the excess halving every 3 KB
    "seg10": {"segment": 10},
    "seg40": {"segment": 40},
    "decay0": {"decay": 0.0},
    # the adapter learns from the loss of what is served, the network mixed with the copy model
    "mixed": {"mixed_loss": True},
    "mixed-lr2x": {"mixed_loss": True, "lr": 2e-4},
    "mixed+bias+out32": {"mixed_loss": True, "bias_lr": 1e-3, "out_rank": 32, "out_lr": 1e-4},
    # the whole output layer (bias and matrix) at full dynamic evaluation's rates, alone and beside M; what
    # full-head does without the weight-norm gains
    "head": {"units": 0, "bias_lr": 1.728e-5, "out_rank": 768, "out_lr": 1.728e-5, "decay": 1e-4},
    "M+head": {"bias_lr": 1.728e-5, "out_rank": 768, "out_lr": 1.728e-5},
    "mixed+M+head": {"mixed_loss": True, "bias_lr": 1.728e-5, "out_rank": 768, "out_lr": 1.728e-5},
    "head-mixed": {"units": 0, "bias_lr": 1.728e-5, "out_rank": 768, "out_lr": 1.728e-5, "decay": 1e-4,
                   "mixed_loss": True},
    # the output layer in a quarter of a megabyte: a rank-64 update of the matrix (6x full's rate, since a
    # projection keeps about r / H of each step) and the bias
    "head64": {"units": 0, "bias_lr": 1.728e-5, "out_rank": 64, "out_lr": 1e-4, "decay": 1e-4},
    # the output matrix's direction v (row norms kept), as full-head-matrix adapts it: whole, and in rank 64
    "headv": {"units": 0, "out_rank": 768, "out_lr": 1.728e-5, "decay": 1e-4, "out_norm": True},
    "headv64": {"units": 0, "out_rank": 64, "out_lr": 1e-4, "decay": 1e-4, "out_norm": True},
    "M+headv64": {"out_rank": 64, "out_lr": 1e-4, "out_norm": True},
    "headv-lr2x": {"units": 0, "out_rank": 768, "out_lr": 3.456e-5, "decay": 1e-4, "out_norm": True},
    "headv-lr4x": {"units": 0, "out_rank": 768, "out_lr": 6.912e-5, "decay": 1e-4, "out_norm": True},
    "headv-lr8x": {"units": 0, "out_rank": 768, "out_lr": 1.3824e-4, "decay": 1e-4, "out_norm": True},
    "headv64-lr4x": {"units": 0, "out_rank": 64, "out_lr": 4e-4, "decay": 1e-4, "out_norm": True},
    "headv-mixed": {"units": 0, "out_rank": 768, "out_lr": 1.728e-5, "decay": 1e-4, "out_norm": True,
                    "mixed_loss": True},
    "M+headv": {"out_rank": 768, "out_lr": 1.728e-5, "out_norm": True},
}
# Served systems: a session's memory settings (`SessionConfig.resolve`'s `asked`), run through `SessionModel`. The head
# memory's rate and decay are bench/head_defaults.py's choice on held-out SMS (prose as a guard).
HEAD_CHOICE = {"lr": 6.912e-5, "decay": 1e-4}
# Each names both learned memories, so that a row means the same whichever the checkpoint serves by default.
SERVED: dict[str, dict[str, object]] = {
    "served-static": {"adapter": None, "head": None},  # static + copy at the session's segment, nothing learned
    "served-session": {"adapter": {}, "head": None},  # M at the "session" settings (served before the head), copy
    "served-head": {"adapter": None, "head": HEAD_CHOICE},  # the output rows' memory instead of M (served now)
    "served-M+head": {"adapter": {}, "head": HEAD_CHOICE},  # both
}
FULL_PARTS = {
    "full": (),
    "full-head": ("head",),
    "full-head-gain": ("head.g", "head.bias"),  # the output layer's per-byte gains (weight norm) and bias
    "full-head-matrix": ("head.v",),
    "full-input": ("embed", "w_x", "w_mx"),
    "full-recurrent": ("w_mh", "w_m"),
}
DEFAULT_SYSTEMS = "static,session,full"
THIRDS = 3  # position split: the text in this many equal parts


def parse_variant(spec: str) -> tuple[str, dict[str, object]]:
    """NAME:key=value,key=value -> (name, overrides); values are ints where they read as ints, else floats."""
    name, _, body = spec.partition(":")
    fields = {f.name for f in dataclasses.fields(VariantConfig)}
    out: dict[str, object] = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--variant {spec!r}: unknown key {key!r}; keys: {', '.join(sorted(fields))}")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        else:
            out[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    if not name:
        raise SystemExit(f"--variant {spec!r}: a name is needed (NAME:key=value,...)")
    return name, out


def run_system(ck: Checkpoint, name: str, data: bytes, copy: CopyModel,
               variants: dict[str, dict[str, object]]) -> dict[str, object]:
    """One pass of system `name` over `data` -> per-byte log-probs (network, with copy), CPU seconds, state bytes."""
    inputs, targets = ck.tokenizer.stream(data, None, torch.device("cpu"))
    t0 = time.process_time()
    if name in SERVED:
        sm = SessionModel.of(ck)
        session = sm.fresh(sm.config(SERVED[name]))  # type: ignore[arg-type]
        text = sm.start(session, data, "observe", shadow=False)
        while not text.job.done:
            sm.step([text.job])
        row = text.job.rows[0]
        mixed = torch.cat(row.logprobs)
        net = torch.full_like(mixed, float("nan"))
        after = sm.observed(session, text, 0.0, 0.0)
        copy_bytes = state_nbytes(after.memories.get("copy"))
        seconds = time.process_time() - t0
        return {"net": net.double().numpy(), "mixed": mixed.double().numpy(), "seconds": seconds,
                "state_bytes": after.nbytes - copy_bytes, "copy_bytes": copy_bytes, "resets": row.resets,
                "dropped": row.dropped, "settings": session.config.to_dict(),
                "memory_bytes": {k: state_nbytes(v) for k, v in after.memories.items()}}
    if name in FULL_PARTS:
        cfg = dataclasses.replace(config_for("dynamic", ck.dyneval), params=FULL_PARTS[name])
        full = FullStream(ck.model, cfg, ck.stats, copy)
        nets, mixes = [], []
        for i in range(0, targets.numel(), cfg.segment):
            mixes.append(full.step(inputs[None, i : i + cfg.segment], targets[None, i : i + cfg.segment]))
            assert full.network_logprobs is not None
            nets.append(full.network_logprobs)
        net, mixed = torch.cat(nets), torch.cat(mixes)
        state_bytes, resets, dropped = full.state_bytes, full.resets, full.skipped
        settings: dict[str, object] = {"lr": cfg.lr, "decay": cfg.decay, "segment": cfg.segment,
                                       "params": list(cfg.params) or "all"}
    else:
        if name == "static":
            config = VariantConfig(units=0, segment=1024)
        elif name == "session":
            config = VariantConfig.from_session(ck.dyneval.session)
        elif name in variants:
            config = VariantConfig.from_session(ck.dyneval.session, **variants[name])
        else:
            raise SystemExit(f"unknown system {name!r}; choose from static, session, {', '.join(FULL_PARTS)}, "
                             f"{', '.join(SERVED)}, {', '.join(variants)}")
        stream = VariantStream(ck.model, config, ck.stats, copy)
        net, mixed_or_none = stream.run(inputs, targets)
        assert mixed_or_none is not None
        mixed = mixed_or_none
        hidden = next(iter(ck.model.adaptation_sites())).dim
        state_bytes = config.state_bytes(hidden, ck.config.vocab_size)
        resets, dropped = stream.resets, stream.dropped
        settings = dataclasses.asdict(config)
    seconds = time.process_time() - t0
    copy_bytes = sum(t.numel() * t.element_size() for t in copy.init_state(1).tensors.values())
    return {"net": net.double().numpy(), "mixed": mixed.double().numpy(), "seconds": seconds,
            "state_bytes": state_bytes, "copy_bytes": copy_bytes, "resets": resets, "dropped": dropped,
            "settings": settings}


def save(path: Path, result: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in result.items() if k not in ("net", "mixed")}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, net=np.asarray(result["net"]), mixed=np.asarray(result["mixed"]), meta=json.dumps(meta))
    tmp.replace(path)


def load(path: Path) -> dict[str, object]:
    with np.load(path) as f:
        return {"net": f["net"], "mixed": f["mixed"], **json.loads(str(f["meta"]))}


# -- kinds of byte ---------------------------------------------------------------------------------------------


def _is_word_byte(b: int) -> bool:
    """Letters, digits, '_' and every byte of a multi-byte UTF-8 character (accented letters)."""
    return b >= 0x80 or chr(b).isalnum() or b == ord("_")


KINDS = ("new word, first byte", "new word, later bytes", "repeated word, first byte", "repeated word, later bytes",
         "space and punctuation")


def byte_kinds(data: bytes) -> np.ndarray:
    """(len(data),) int: the index into KINDS of each byte. A word is a maximal run of word bytes; it is repeated
    when the same run (case and all) ended earlier in the text."""
    kinds = np.full(len(data), 4, dtype=np.int8)
    seen: set[bytes] = set()
    i = 0
    while i < len(data):
        if not _is_word_byte(data[i]):
            i += 1
            continue
        j = i
        while j < len(data) and _is_word_byte(data[j]):
            j += 1
        word = data[i:j]
        repeated = word in seen
        kinds[i] = 2 if repeated else 0
        kinds[i + 1 : j] = 3 if repeated else 1
        seen.add(word)
        i = j
    return kinds


# -- the report ------------------------------------------------------------------------------------------------


def bpb(lp: np.ndarray, where: np.ndarray | slice | None = None) -> float:
    part = lp if where is None else lp[where]
    return float(-part.sum() / LN2 / max(part.size, 1))


def report(out: Path, texts: list[str], systems: list[str], limit: int, datas: dict[str, bytes]) -> None:
    results: dict[tuple[str, str], dict[str, object]] = {}
    for s in systems:
        for t in texts:
            path = out / s / f"{t}.npz"
            if path.exists():
                results[s, t] = load(path)
    if not results:
        print("nothing measured yet")
        return

    def get(s: str, t: str, key: str) -> np.ndarray | None:
        r = results.get((s, t))
        return None if r is None else np.asarray(r[key])

    def cell(v: float | None, fmt: str = "{:.3f}") -> str:
        return "" if v is None or v != v else fmt.format(v)

    print(f"## bits per byte, first {limit:,} bytes of each text (network / with the copy model)\n")
    print("| system | " + " | ".join(texts) + " |")
    print("| --- | " + " | ".join("---:" for _ in texts) + " |")
    for s in systems:
        row = []
        for t in texts:
            net, mixed = get(s, t, "net"), get(s, t, "mixed")
            net_cell = "-" if net is not None and np.isnan(net).any() else f"{bpb(net):.3f}" if net is not None else ""
            row.append("" if net is None or mixed is None else f"{net_cell} / {bpb(mixed):.3f}")
        print(f"| {s} | " + " | ".join(row) + " |")
    print("\n## with the copy model: gain over static + copy, and its fraction of full + copy's gain\n")
    print("| system | " + " | ".join(texts) + " | mean fraction |")
    print("| --- | " + " | ".join("---:" for _ in texts) + " | ---: |")
    for s in systems:
        row, fracs = [], []
        for t in texts:
            mixed, base, full = get(s, t, "mixed"), get("static", t, "mixed"), get("full", t, "mixed")
            if mixed is None or base is None:
                row.append("")
                continue
            gain = 1 - bpb(mixed) / bpb(base)
            text = f"{100 * gain:+.1f}%"
            if full is not None and s != "static":
                full_gain = 1 - bpb(full) / bpb(base)
                if full_gain > 0:
                    fracs.append(gain / full_gain)
                    text += f" ({100 * gain / full_gain:.0f}%)"
            row.append(text)
        mean = f"{100 * sum(fracs) / len(fracs):.0f}%" if len(fracs) == len(texts) else ""
        print(f"| {s} | " + " | ".join(row) + f" | {mean} |")
    print("\n## cost a byte (CPU time, one stream) relative to static + copy, and state a stream\n")
    print("| system | time vs static + copy | adapted state (bytes) | with the copy model (bytes) | resets |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base_rate = _rate(results, "static", texts)
    for s in systems:
        rate = _rate(results, s, texts)
        any_r = next((results[s, t] for t in texts if (s, t) in results), None)
        if any_r is None:
            continue
        resets = sum(int(results[s, t]["resets"]) for t in texts if (s, t) in results)  # type: ignore[call-overload]
        sb, cb = int(any_r["state_bytes"]), int(any_r["copy_bytes"])  # type: ignore[call-overload]
        ratio = cell(rate / base_rate if rate and base_rate else None, "{:.2f}x")
        print(f"| {s} | {ratio} | {sb:,} | {sb + cb:,} | {resets} |")
    _by_position(texts, systems, get)
    _by_kind(texts, systems, get, datas)


def _rate(results: dict[tuple[str, str], dict[str, object]], s: str, texts: list[str]) -> float | None:
    done = [results[s, t] for t in texts if (s, t) in results]
    if not done:
        return None
    seconds = sum(float(r["seconds"]) for r in done)  # type: ignore[arg-type, misc]
    size = sum(np.asarray(r["net"]).size for r in done)
    return seconds / size


def _by_position(texts: list[str], systems: list[str], get: Callable[[str, str, str], np.ndarray | None]) -> None:
    print(f"\n## by position (the text in {THIRDS} equal parts), with the copy model: bits per byte, and the "
          "system's gain over static + copy as a fraction of full + copy's in that part\n")
    shown = [s for s in systems if s != "static"]
    print("| text | part | static + copy | " + " | ".join(f"{s} + copy" for s in shown) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in shown) + " |")
    for t in texts:
        base = get("static", t, "mixed")
        if base is None:
            continue
        n = base.size
        for p in range(THIRDS):
            part = slice(p * n // THIRDS, (p + 1) * n // THIRDS)
            b = bpb(base, part)
            full = get("full", t, "mixed")
            full_gain = b - bpb(full, part) if full is not None else None
            cells = []
            for s in shown:
                m = get(s, t, "mixed")
                if m is None:
                    cells.append("")
                    continue
                v = bpb(m, part)
                frac = f" ({100 * (b - v) / full_gain:.0f}%)" if full_gain and s != "full" else ""
                cells.append(f"{v:.3f}{frac}")
            print(f"| {t} | {p + 1} | {b:.3f} | " + " | ".join(cells) + " |")


def _by_kind(texts: list[str], systems: list[str], get: Callable[[str, str, str], np.ndarray | None],
             datas: dict[str, bytes]) -> None:
    for key, label_of in (("mixed", "with the copy model"), ("net", "the network alone")):
        base_name = "static + copy" if key == "mixed" else "static"
        print(f"\n## by kind of byte, {label_of}: share of the bytes, bits per byte of {base_name}, and each "
              "system's saving over it in bits per byte of that kind\n")
        shown = [s for s in systems if s != "static"]
        suffix = " + copy" if key == "mixed" else ""
        print(f"| text | kind | bytes | {base_name} | " + " | ".join(f"{s}{suffix}" for s in shown) + " |")
        print("| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in shown) + " |")
        for t in texts:
            base = get("static", t, key)
            if base is None:
                continue
            kinds = byte_kinds(datas[t][: base.size])
            for k, label in enumerate(KINDS):
                where = kinds == k
                if not where.any():
                    continue
                b = bpb(base, where)
                cells = []
                for s in shown:
                    m = get(s, t, key)
                    cells.append("" if m is None else f"{b - bpb(m, where):+.3f}")
                print(f"| {t} | {label} | {100 * where.mean():.0f}% | {b:.3f} | " + " | ".join(cells) + " |")
    print("\n## where full + copy's lead over session + copy lies: each kind's share of the bits full saves more\n")
    print("| text | " + " | ".join(KINDS) + " | total (bits per byte) |")
    print("| --- | " + " | ".join("---:" for _ in KINDS) + " | ---: |")
    for t in texts:
        full, sess = get("full", t, "mixed"), get("session", t, "mixed")
        if full is None or sess is None:
            continue
        kinds = byte_kinds(datas[t][: full.size])
        diff = (full - sess) / LN2  # bits full saves more at each byte
        total = float(diff.sum())
        shares = [f"{100 * float(diff[kinds == k].sum()) / total:.0f}%" if total else "" for k in range(len(KINDS))]
        print(f"| {t} | " + " | ".join(shares) + f" | {total / full.size:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--limit", type=int, default=30_000)
    ap.add_argument("--texts", default=",".join(TEXTS))
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS,
                    help=f"static, session, {', '.join(FULL_PARTS)}, {', '.join(SERVED)}, or a variant: "
                         f"{', '.join(VARIANTS)}")
    ap.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (VariantConfig keys)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "adapt_losses"))
    ap.add_argument("--report", action="store_true", help="only print the tables of what --out holds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = dict(VARIANTS)
    for spec in args.variant:
        name, overrides = parse_variant(spec)
        variants[name] = overrides
    ck = load_checkpoint(args.checkpoint)
    copy = CopyModel(copy_config(ck), ck.config.vocab_size)
    texts = [t for t in args.texts.split(",") if t]
    systems = [s for s in args.systems.split(",") if s]
    out = Path(args.out) / f"{Path(args.checkpoint).name}-{args.limit}"
    datas = {t: data_file(TEXTS[t][1]).read_bytes()[: args.limit] for t in texts}
    print(f"# where the session's learned gain is lost, {ck.name}: {machine_line()}")
    if not args.report:
        for s in systems:
            for t in texts:
                path = out / s / f"{t}.npz"
                if path.exists():
                    continue
                result = run_system(ck, s, datas[t], copy, variants)
                save(path, result)
                print(f"{s} {t}: {bpb(np.asarray(result['net'])):.4f} / {bpb(np.asarray(result['mixed'])):.4f} bpb, "
                      f"{result['seconds']:.0f} CPU s", flush=True)
    report(out, texts, systems, args.limit, datas)


if __name__ == "__main__":
    main()
