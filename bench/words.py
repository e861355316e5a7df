"""Word-level models on PTB and WikiText-2: validation perplexity of word checkpoints under static
scoring, the neural cache, and sparse and full dynamic evaluation, in domain (PTB valid) and out of domain
(WikiText-2 valid scored by a PTB-trained model). PTB and WikiText are research-only: the checkpoints this reads are
trained under runs/ and never shipped.

    python -m bench.words --checkpoints runs/ptb/ntasgd,runs/ptb/adaptive [--tune-bytes 60000] [--words 20000]
                          [--modes static,cache,sparse,full] [--last-iterate]

`--last-iterate` also scores each checkpoint's last training iterate (the weights in `<checkpoint>/last/`, which the
trainer keeps to resume): for an NT-ASGD run that is the plain SGD trajectory (averaging never changes the
iterates), so the two rows compare SGD with NT-ASGD on one run.

Settings, tuned per checkpoint on the first `--tune-bytes` of PTB valid (`adaptlm tune` in this process): the cache's
theta and lambda at a window of 500 words (`tune_cache`), and the sparse and full learning rates and decays
(`tune_mode`, `--max-trials` trials each). The table scores the `--words` words of PTB valid that follow the tuning
slice, and the first `--words` words of WikiText-2 valid: every mode the same text. Perplexity = 2 ** bits per word
(every token counts, end of line included); bits per byte are of the raw text. WikiText-2 is cased and has a
33K-word vocabulary: every word a PTB vocabulary lacks is one <unk> token, so the out-of-domain perplexity is over
<unk>-heavy text (the share is printed), as the papers' cross-corpus figures are not.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from safetensors.torch import load_file

from bench._common import data_file, machine_line
from models.adaptation import CacheConfig, DynEvalConfig, evaluate
from models.checkpoint import Checkpoint, load_checkpoint
from models.tokenizer import Tokenizer
from trainer.evaluation import config_for
from trainer.tune import tune_cache, tune_mode

PTB_VALID = "ptb/ptb.valid.txt"
WT2_VALID = "wikitext-2/wiki.valid.tokens"
WINDOW = 500


def words_slice(text: bytes, tok: Tokenizer, start_bytes: int, words: int) -> bytes:
    """`words` tokens of `text` from its first line start at or after `start_bytes`, cut at a line end."""
    start = text.find(b"\n", start_bytes) + 1 if start_bytes else 0
    lines, n, out = text[start:].split(b"\n"), 0, []
    for line in lines:
        out.append(line + b"\n")
        n += len(tok.encode(line + b"\n"))
        if n >= words:
            break
    return b"".join(out)


def tuned(ck: Checkpoint, tune_text: bytes, max_trials: int) -> dict[str, DynEvalConfig]:
    tok = ck.tokenizer
    cache, _ = tune_cache(ck.model, tune_text, WINDOW, tokenizer=tok)
    out = {"static": DynEvalConfig(mode="static"), "cache": DynEvalConfig(mode="static", cache=cache)}
    for mode, name in (("sparse", "sparse"), ("full", "dynamic")):
        base = config_for(name, ck.dyneval)
        best, _ = tune_mode(ck.model, ck.stats, tune_text[:20_000], base, lr_start=1e-5, max_trials=max_trials,
                            tokenizer=tok)
        out[mode] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", type=lambda s: s.split(","), required=True)
    ap.add_argument("--tune-bytes", type=int, default=60_000)
    ap.add_argument("--words", type=int, default=20_000)
    ap.add_argument("--max-trials", type=int, default=8)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["static", "cache", "sparse", "full"])
    ap.add_argument("--last-iterate", action="store_true", help="also score the run's last iterate (SGD's)")
    args = ap.parse_args()
    print(f"# word models: {machine_line()}")
    ptb = data_file(PTB_VALID).read_bytes()
    wt2 = data_file(WT2_VALID).read_bytes()
    runs = [(path, False) for path in args.checkpoints]
    if args.last_iterate:
        runs += [(path, True) for path in args.checkpoints]
    for path, last in runs:
        ck = load_checkpoint(path)
        if last:  # the trainer's resumable weights: the iterate, not the average
            weights = load_file(str(Path(path) / "last" / "trainer_state.safetensors"))
            ck.model.load_state_dict({k[6:]: v for k, v in weights.items() if k.startswith("model.")})
            path = f"{path} (last iterate)"
        tok = ck.tokenizer
        if not tok.reports_tokens:
            raise SystemExit(f"{path}: not a word model")
        training = ck.meta.get("training", {})
        print(f"\n## {path}: {ck.model.config.arch}, {sum(p.numel() for p in ck.model.parameters()):,} parameters, "
              f"vocabulary {tok.vocab_size:,}, {training.get('steps')} steps in {training.get('seconds', 0) / 60:.0f}"
              f" min; averaging from step {ck.meta['metrics'].get('averaging_from_step')}")
        configs = tuned(ck, ptb[: args.tune_bytes], args.max_trials)
        c = configs["cache"].cache
        assert c is not None
        print(f"tuned on PTB valid bytes 0-{args.tune_bytes:,}: cache window {c.window} theta {c.theta:g} lambda "
              f"{c.lam:g}; sparse lr {configs['sparse'].lr:.3g} decay {configs['sparse'].decay:g}; full lr "
              f"{configs['full'].lr:.3g} decay {configs['full'].decay:g}")
        texts = {"PTB valid": words_slice(ptb, tok, args.tune_bytes, args.words),
                 "WikiText-2 valid": words_slice(wt2, tok, 0, args.words)}
        print("| text | words | <unk> | " + " | ".join(f"{m} ppl (bpb)" for m in args.modes) + " |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in args.modes) + " |")
        for name, text in texts.items():
            ids = tok.encode(text)
            unk = sum(i in (tok.unk, tok.unk + 1) for i in ids) / len(ids)
            cells = []
            for mode in args.modes:
                cfg = configs[mode] if mode in configs else replace(configs["static"], cache=CacheConfig())
                r = evaluate(ck.model, text, cfg, stats=ck.stats, tokenizer=tok)
                cells.append(f"{2 ** r.bits_per_token:.1f} ({r.bits_per_byte:.3f})")
            print(f"| {name} | {len(ids):,} | {100 * unk:.1f}% | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
