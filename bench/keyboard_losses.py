"""Where a keyboard session loses keystrokes: the simulator of `bench.keyboard` (adaptlm_client.keysim, 3 suggestions),
in this process (the session's sparse settings, the checkpoint's copy model and word cache, as `bench.cache_weight`),
on held-out personal text that no benchmark types, with every word's outcome recorded and its lost keystrokes
classified.

    python -m bench.keyboard_losses [--texts emails,sms] [--slice analysis|check] [--out runs/keyboard_losses]

A word's *ideal* saving is what taking it before any of its characters would save: its length, plus its space when
one follows, less the selection; its *loss* is the ideal less what the typist saved. Losses are classified by what
the word is to the session when it is typed (the words observed so far: the warm-up and the messages before it):

- seen: typed before in exactly this form;
- other case: typed before only with other capitals ("The" after "the");
- unseen, known: never typed in the session but a word of the model's training text (the model may know it);
- unseen, new: neither (a name, a code, a misspelling): only its characters can bring it;
- number: it has a digit;

and by when it was offered (before any character, after 1, 2, 3+ characters, never), with, for the words not
offered before their first character, their rank among 10 suggestions at that point (a wider bar's), and whether a
word differing only in case was offered instead.

Slices (bytes of each file; the keyboard benchmark types the e-mails' last 40 KB and the SMS file's last 20 KB,
`bench.cache_weight` tuned on SMS 30-38 KB and e-mails 1,030,000-1,038,000, `bench.copy_defaults` on the SMS file's
first 30 KB and 130-150 KB):
- analysis (what the analysis and any tuning read): e-mails 1,500,000-1,530,000 observed, 1,530,000-1,540,000 typed;
  SMS 160,000-190,000 observed, 190,000-200,000 typed;
- check (a second held-out slice, read once a change is chosen): `bench.cache_weight`'s.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptlm_client.keysim import KeysimResult, Suggester, messages, split_text, split_words
from bench._common import DEFAULT_CHECKPOINT, ROOT, data_file, machine_line

SLICES = {  # name -> {slice: (file, warm-up start, typed start, typed end)}
    "emails": {"analysis": ("messages/enron-farmer-d.first2672.txt", 1_500_000, 1_530_000, 1_540_000),
               "check": ("messages/enron-farmer-d.first2672.txt", 1_000_000, 1_030_000, 1_038_000)},
    "sms": {"analysis": ("messages/sms_ham.train.txt", 160_000, 190_000, 200_000),
            "check": ("messages/sms_ham.train.txt", 0, 30_000, 38_000)},
}
CLASSES = ("seen", "other case", "unseen, known", "unseen, new", "number")
WHEN = ("before typing", "after 1", "after 2", "after 3+", "never")
WIDE = 10  # the diagnostic bar's width


@dataclass
class WordOutcome:
    word: str
    kind: str  # one of CLASSES
    taken_at: int | None  # characters typed before it was taken (None: never offered)
    ideal: int  # keys taking it at once would save
    saved: int  # keys it saved
    wide_rank: int | None  # its rank (1-based) in a bar of WIDE before its first character, None: not there
    case_offered: bool  # a form in other case was offered while it was typed
    first_of_message: bool
    after_punct: bool  # the word follows punctuation (not only spaces) within its message
    shown: list[str] = field(default_factory=list)  # the bar before its first character


class Recorder:
    """Wraps a suggester: types like `adaptlm_client.keysim.type_message` (same accounting, checked against it) and
    records each word's outcome."""

    def __init__(self, inner: Suggester, known: set[str], k: int = 3) -> None:
        self.inner, self.known, self.k = inner, known, k
        self.seen: set[str] = set()
        self.seen_lower: set[str] = set()
        self.outcomes: list[WordOutcome] = []
        self.latencies: list[float] = []

    def observe(self, text: str) -> None:
        self.inner.observe(text)
        for s, e in split_words(text):
            self.seen.add(text[s:e])
            self.seen_lower.add(text[s:e].lower())

    def kind(self, word: str) -> str:
        if any(c.isdigit() for c in word):
            return "number"
        if word in self.seen:
            return "seen"
        if word.lower() in self.seen_lower:
            return "other case"
        return "unseen, known" if word in self.known or word.lower() in self.known else "unseen, new"

    def type(self, message: str, result: KeysimResult) -> None:
        before = (result.typed, result.selections)
        typed = selections = 0
        i = 0
        for start, end in split_words(message):
            typed += start - i
            word = message[start:end]
            space = end < len(message) and message[end] == " "
            i = end
            taken = None
            case_offered = False
            shown: list[str] = []
            wide_rank = None
            for p in range(len(word)):
                t0 = time.perf_counter()
                words = list(self.inner.suggest(message[:start + p], max(self.k, 3) if p == 0 else self.k))
                self.latencies.append(time.perf_counter() - t0)
                if p == 0:
                    shown = words[:3]
                if word in words[: self.k]:
                    taken = p
                    break
                if p == 0:  # not in the bar: where is it in a wider one?
                    wide = list(self.inner.suggest(message[:start], WIDE))
                    wide_rank = wide.index(word) + 1 if word in wide else None
                case_offered |= any(w != word and w.lower() == word.lower() for w in words[: self.k])
                typed += 1
            if taken is not None:
                selections += 1
                if space:
                    i = end + 1
            ideal = len(word) + space - 1
            saved = len(word) - taken + space - 1 if taken is not None else 0
            pre = message[:start].rstrip(" ")
            self.outcomes.append(WordOutcome(word, self.kind(word), taken, ideal, saved,
                                             1 if taken == 0 else wide_rank, case_offered, not pre.strip(),
                                             bool(pre) and not pre[-1].isalnum() and pre[-1] not in "'\u2019",
                                             shown))
        typed += len(message) - i
        result.chars += len(message)
        result.typed += typed
        result.selections += selections
        result.words += len(split_words(message))
        result.messages += 1
        assert (result.typed, result.selections) == (before[0] + typed, before[1] + selections)


def training_words() -> set[str]:
    from bench.keyboard import train_files

    known: set[str] = set()
    for path in train_files():
        known.update(re.findall(r"[^\W_]+(?:['\u2019][^\W_]+)*", path.read_text(encoding="utf-8", errors="ignore")))
    return known


def report(name: str, rec: Recorder, result: KeysimResult) -> dict[str, Any]:
    chars = result.chars
    out: dict[str, Any] = {"text": name, "chars": chars, "ksr": result.ksr, "words": len(rec.outcomes)}
    ideal = sum(o.ideal for o in rec.outcomes)
    out["oracle_ksr"] = ideal / chars  # every word taken before its first character
    loss: Counter[tuple[str, str]] = Counter()
    count: Counter[tuple[str, str]] = Counter()
    for o in rec.outcomes:
        when = "never" if o.taken_at is None else WHEN[min(o.taken_at, 3)]
        loss[o.kind, when] += o.ideal - o.saved
        count[o.kind, when] += 1
    out["loss_points"] = {f"{c} / {w}": 100 * loss[c, w] / chars for c in CLASSES for w in WHEN if count[c, w]}
    out["words_by"] = {f"{c} / {w}": count[c, w] for c in CLASSES for w in WHEN if count[c, w]}
    late = [o for o in rec.outcomes if o.taken_at != 0]
    ranks = Counter("4-10" if o.wide_rank is not None else "not in 10" for o in late)
    out["not_first_rank"] = dict(ranks)
    out["not_first_rank_loss_points"] = {
        r: 100 * sum(o.ideal - o.saved for o in late if ("4-10" if o.wide_rank is not None else "not in 10") == r)
        / chars for r in ranks}
    out["case_offered_loss_points"] = 100 * sum(o.ideal - o.saved for o in rec.outcomes if o.case_offered) / chars
    out["message_start_loss_points"] = 100 * sum(o.ideal - o.saved for o in rec.outcomes if o.first_of_message) / chars
    out["after_punct_loss_points"] = 100 * sum(o.ideal - o.saved for o in rec.outcomes if o.after_punct) / chars
    out["short_words_loss_points"] = {  # by length
        n: 100 * sum(o.ideal - o.saved for o in rec.outcomes if min(len(o.word), 8) == n) / chars for n in range(1, 9)}
    lat = sorted(rec.latencies)
    out["suggest_ms_p50"] = 1000 * lat[len(lat) // 2] if lat else None
    out["suggest_ms_p99"] = 1000 * lat[int(len(lat) * 0.99)] if lat else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--texts", default=",".join(SLICES))
    ap.add_argument("--slice", default="analysis", choices=("analysis", "check"))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "keyboard_losses")
    args = ap.parse_args()
    from models.checkpoint import load_checkpoint
    from models.copymodel import CopyModel
    from models.keysim import ModelSuggester

    ckpt = load_checkpoint(args.checkpoint)
    copy = CopyModel(ckpt.dyneval.copy) if ckpt.dyneval.copy is not None else None
    known = training_words()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"# keyboard losses, {ckpt.name}, slice {args.slice}: {machine_line()}", flush=True)
    for name in args.texts.split(","):
        rel, w0, t0, t1 = SLICES[name][args.slice]
        warm, typed = split_text(data_file(rel).read_bytes()[w0:t1], last_bytes=t1 - t0)
        sim = ModelSuggester(ckpt.model, ckpt.dyneval.session, stats=ckpt.stats, copy=copy,
                             cache_weight=ckpt.dyneval.cache_weight, lexicon=ckpt.lexicon)
        rec = Recorder(sim, known)
        result = KeysimResult()
        start = time.perf_counter()
        for m in messages(warm):
            rec.observe(m)
        for m in messages(typed):
            rec.type(m, result)
            rec.observe(m)
        summary = report(name, rec, result)
        summary["seconds"] = time.perf_counter() - start
        (args.out / f"{name}.{args.slice}.json").write_text(json.dumps(summary, indent=1) + "\n")
        with (args.out / f"{name}.{args.slice}.words.jsonl").open("w") as f:
            for o in rec.outcomes:
                f.write(json.dumps(o.__dict__) + "\n")
        print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
