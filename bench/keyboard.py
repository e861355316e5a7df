"""Keystroke savings against Presage: our default model (static, session adaptation over HTTP, full dynamic
evaluation in-process) and Presage (an n-gram predictor built from the same training text, without and with
learning), all typed by the same simulator (adaptlm_client.keysim: Presage's KSR definition, 3 suggestions). The
sessions run as served (the weights the checkpoint's sessions learn by default: the output rows' delta "head",
models/adaptation/_head_memory.py, on checkpoints/default, the sparse adapter M where the checkpoint keeps it on;
the copy model when the checkpoint has one, models/copymodel.py; and the session word cache,
models/wordcache.py), without the word cache, and without the copy model (a copy of the
checkpoint without dyneval.json's "copy" section); full dynamic evaluation runs without and with the word cache,
and with the copy model and the word cache.

    python -m bench.keyboard [--checkpoint DIR] [--texts emails,sms] [--systems presage,presage-learn,static,...]
                             [--limit-bytes N] [--warmup-bytes N] [--out runs/keyboard] [--force] [--table-only]
                             [--suggest-budget-ms 0]

The HTTP rows' servers run exact suggestion searches (`--suggest-budget-ms 0`), as the in-process rows do: under the
served default (a 50 ms budget) a search on a busy machine answers with what it found in time, so KSR and top-k
would depend on the load; each record keeps the budget and the share of suggestions it cut ("suggest_cut").

Needs `make bench-deps` (Debian's presage and libpresage-data). Presage runs in this process through its C API
(libpresage.so.1, ctypes): its past stream is the last 400 characters observed and the message typed so far;
"learning" = its user n-gram predictor (a fresh database per run) learning each finished message through
`presage_learn`, plus its recency predictor; without learning, the smoothed 3-gram predictor on our training
text alone. Its n-gram database is built once with `text2ngram` (1-, 2- and 3-grams, case kept) from the
default checkpoint's training text (the Makefile's DEFAULT_TRAIN). `presage_simulator` itself is also run on
each measured text with both configurations, as a cross-check of its own KSR figure (whitespace tokens).

`--checkpoint DIR` measures our systems on another checkpoint (default: checkpoints/default). A word-level one
(config.json's tokenizer of kind "words", models/word_tokenizer.py) is measured through its server only: "static"
and "sparse" (its session as served: what it learns, and the copy model when its dyneval.json has one, or the neural
cache when its "session" section turns it on; a word model's suggestions have no word cache). The in-process
systems (full, full-cache, full-copy: the byte search of models/keysim.py) and the variants that switch off the
word cache or keep it without the copy model (sparse-nocache, sparse-nocopy) are refused when asked for and
skipped, with the reason, when only implied by the default --systems. Presage does not depend on the checkpoint
and runs as with the default one.

Each (text, system) result is written to OUT/<text>.<system>.json as it finishes (our systems on a checkpoint
other than the default: OUT/<text>.<system>@<checkpoint directory's name>.json; Presage's are shared) and skipped
on a later run (unless --force), so the run can be resumed; the table is printed from every result present, each
of our rows naming its checkpoint when OUT holds results of more than one.

e.g. a word model against the default's rows already in runs/keyboard:

    OMP_NUM_THREADS=1 python -m bench.keyboard --checkpoint checkpoints/words --systems static,sparse --texts emails
                                               --limit-bytes 20000 --warmup-bytes 30000
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptlm_client import Client
from adaptlm_client.keysim import KeysimResult, SessionSuggester, messages, simulate, split_text
from bench._common import DEFAULT_CHECKPOINT, ROOT, data_file, machine_line
from bench.server import serve, suggest_cut
from models.adaptation import DynEvalSettings
from models.tokenizer import tokenizer_from_dict

TEXTS = {  # name -> (label, file, bytes measured at its end)
    "emails": ("e-mails (enron-farmer-d)", "messages/enron-farmer-d.first2672.txt", 40_000),
    "sms": ("SMS (sms_ham.train)", "messages/sms_ham.train.txt", 20_000),
}
HELD_OUT = ("austen-persuasion.txt", "chesterton-brown.txt")
SYSTEMS = {
    "presage": "Presage, no learning",
    "presage-learn": "Presage, learning",
    "static": "ours, static (HTTP)",
    # a session's row names its parts from its record (row_label); these are the names of records that keep none
    "sparse-nocache": "ours, session without the word cache (HTTP)",
    "sparse-nocopy": "ours, session without the copy model (HTTP)",
    "sparse": "ours, session as served (HTTP)",
    "sparse-noneural": "ours, session without the neural cache (HTTP)",
    "full": "ours, full dynamic evaluation (in-process)",
    "full-cache": "ours, full dynamic evaluation + word cache (in-process)",
    "full-copy": "ours, full dynamic evaluation + copy model + word cache (in-process)",
}
# what a word model is measured on: its server (module docstring); it has no copy model to leave out
WORD_SYSTEMS = ("static", "sparse", "sparse-nocache", "sparse-noneural")
LEARNED = ("adapter", "head")  # the session memories that learn weights: the sparse adapter M, the output rows' delta
K = 3
PAST_CHARS = 400  # of observed text in Presage's past stream (it reads the last few words)


def train_files() -> list[Path]:
    books = sorted(p for p in data_file("gutenberg").glob("*.txt") if p.name not in HELD_OUT)
    return [*books, data_file("tinyshakespeare/input.txt")]


# -- Presage ---------------------------------------------------------------------------------------------------


def build_presage_db(db: Path) -> Path:
    """Presage's n-gram database of our training text at `db` (kept: built once, ~2 minutes)."""
    if db.exists():
        return db
    tmp = db.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    files = [str(p) for p in train_files()]
    for n in (1, 2, 3):
        subprocess.run(["text2ngram", "-n", str(n), "-f", "sqlite", "-o", str(tmp), *(["-a"] if n > 1 else []),
                        *files], check=True, capture_output=True)
    tmp.rename(db)
    return db


def presage_config(out: Path, db: Path, learn: bool, name: str) -> Path:
    """A presage.xml: our database, K suggestions; with `learn`, a user n-gram database of its own and recency."""
    user_db = out / f"{name}.user.db"
    user_db.unlink(missing_ok=True)
    predictors = "DefaultSmoothedNgramPredictor" + (" UserSmoothedNgramPredictor DefaultRecencyPredictor"
                                                    if learn else "")
    xml = f"""<?xml version="1.0" encoding="UTF-8" standalone="no" ?>
<Presage>
  <PredictorRegistry><LOGGER>ERROR</LOGGER><PREDICTORS>{predictors}</PREDICTORS></PredictorRegistry>
  <ContextTracker><LOGGER>ERROR</LOGGER><SLIDING_WINDOW_SIZE>80</SLIDING_WINDOW_SIZE>
    <LOWERCASE_MODE>no</LOWERCASE_MODE><ONLINE_LEARNING>{"yes" if learn else "no"}</ONLINE_LEARNING></ContextTracker>
  <Selector><LOGGER>ERROR</LOGGER><SUGGESTIONS>{K}</SUGGESTIONS><REPEAT_SUGGESTIONS>no</REPEAT_SUGGESTIONS>
    <GREEDY_SUGGESTION_THRESHOLD>0</GREEDY_SUGGESTION_THRESHOLD></Selector>
  <PredictorActivator><LOGGER>ERROR</LOGGER><PREDICT_TIME>1000</PREDICT_TIME>
    <MAX_PARTIAL_PREDICTION_SIZE>60</MAX_PARTIAL_PREDICTION_SIZE>
    <COMBINATION_POLICY>Meritocracy</COMBINATION_POLICY></PredictorActivator>
  <ProfileManager><LOGGER>ERROR</LOGGER><AUTOPERSIST>false</AUTOPERSIST></ProfileManager>
  <Predictors>
    <DefaultSmoothedNgramPredictor><PREDICTOR>SmoothedNgramPredictor</PREDICTOR><LOGGER>ERROR</LOGGER>
      <DBFILENAME>{db}</DBFILENAME><DELTAS>0.01 0.1 0.89</DELTAS><LEARN>false</LEARN>
      <DatabaseConnector><LOGGER>ERROR</LOGGER></DatabaseConnector></DefaultSmoothedNgramPredictor>
    <UserSmoothedNgramPredictor><PREDICTOR>SmoothedNgramPredictor</PREDICTOR><LOGGER>ERROR</LOGGER>
      <DBFILENAME>{user_db}</DBFILENAME><DELTAS>0.01 0.1 0.89</DELTAS><LEARN>true</LEARN>
      <DatabaseConnector><LOGGER>ERROR</LOGGER></DatabaseConnector></UserSmoothedNgramPredictor>
    <DefaultRecencyPredictor><PREDICTOR>RecencyPredictor</PREDICTOR><LOGGER>ERROR</LOGGER>
      <LAMBDA>1</LAMBDA><N_0>1</N_0><CUTOFF_THRESHOLD>20</CUTOFF_THRESHOLD></DefaultRecencyPredictor>
  </Predictors>
</Presage>
"""
    path = out / f"{name}.xml"
    path.write_text(xml)
    return path


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)  # returns a const char* that we keep alive


class PresageSuggester:
    """Presage through its C API (presage.h): the `adaptlm_client.keysim.Suggester` protocol. `learn`: each finished
    message is learnt (`presage_learn`); the context tracker's own online learning is off in both
    configurations, so what it learns is exactly what the simulator observes."""

    def __init__(self, config: Path, learn: bool) -> None:
        self.lib = ctypes.CDLL("libpresage.so.1")
        self.lib.presage_new_with_config.argtypes = [_CALLBACK, ctypes.c_void_p, _CALLBACK, ctypes.c_void_p,
                                                     ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
        self.lib.presage_predict.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_char_p))]
        self.lib.presage_learn.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self.lib.presage_config_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        self.lib.presage_free_string_array.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
        self.lib.presage_free.argtypes = [ctypes.c_void_p]
        self.learn = learn
        self.past = ""
        self._context = ctypes.create_string_buffer(b"")
        self._empty = ctypes.create_string_buffer(b"")
        self._past_cb = _CALLBACK(lambda _: ctypes.addressof(self._context))
        self._future_cb = _CALLBACK(lambda _: ctypes.addressof(self._empty))
        self.handle = ctypes.c_void_p()
        self._check(self.lib.presage_new_with_config(self._past_cb, None, self._future_cb, None,
                                                     str(config).encode(), ctypes.byref(self.handle)), "new")
        # the configuration file's ONLINE_LEARNING names the variant; explicit presage_learn does the learning
        self._check(self.lib.presage_config_set(self.handle, b"Presage.ContextTracker.ONLINE_LEARNING", b"no"),
                    "config")

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"presage_{what} failed with error code {code}")

    def suggest(self, context: str, k: int) -> list[str]:
        self._context = ctypes.create_string_buffer((self.past + context).encode("utf-8"))
        result = ctypes.POINTER(ctypes.c_char_p)()
        self._check(self.lib.presage_predict(self.handle, ctypes.byref(result)), "predict")
        words = []
        i = 0
        while result[i] is not None:
            words.append(result[i].decode("utf-8", "replace"))
            i += 1
        self.lib.presage_free_string_array(result)
        return words[:k]

    def observe(self, text: str) -> None:
        if self.learn:
            self._check(self.lib.presage_learn(self.handle, text.encode("utf-8")), "learn")
        self.past = (self.past + text)[-PAST_CHARS:]

    def close(self) -> None:
        self.lib.presage_free(self.handle)


def presage_simulator_ksr(config: Path, text: str, out: Path) -> float | None:
    """presage_simulator's own KSR (percent / 100) on `text`, or None if it is not installed."""
    exe = shutil.which("presage_simulator")
    if exe is None:
        return None
    path = config.with_suffix(".input.txt")
    path.write_text(text, encoding="utf-8")
    r = subprocess.run([exe, "-q", "-c", str(config), str(path)], capture_output=True, text=True)
    found = re.search(r"KSR:\s*([-0-9.eE+]+)", r.stdout)
    if r.returncode != 0 or not found:  # with online learning it can abort (an assertion in its n-gram predictor)
        print(f"  presage_simulator failed ({r.returncode}): {r.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return float(found.group(1)) / 100


# -- the checkpoint ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    """The checkpoint our systems run: `tag` names its results (None: the default checkpoint, whose results keep
    their names), `tokenizer` its tokenizer's kind, `copy` whether its sessions have a copy model, `learned` the
    memories whose weights its sessions learn by default (`default_learned`)."""

    path: Path
    tag: str | None
    tokenizer: str
    copy: bool
    learned: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.path.name


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    """What the systems need to know of the checkpoint at `path`, from its JSON files (the weights stay on disk);
    raises ValueError (or OSError) on a directory that is not one."""
    resolved = path.resolve()
    config = json.loads((resolved / "config.json").read_text(encoding="utf-8"))
    dyneval = DynEvalSettings(json.loads((resolved / "dyneval.json").read_text(encoding="utf-8")))
    tag = None if resolved == DEFAULT_CHECKPOINT.resolve() else resolved.name
    return CheckpointInfo(resolved, tag, tokenizer_from_dict(config.get("tokenizer")).kind, dyneval.copy is not None,
                          default_learned(dyneval))


def default_learned(dyneval: Mapping[str, Any]) -> tuple[str, ...]:
    """The memories of `LEARNED` a checkpoint's sessions have unless they ask otherwise, from its dyneval.json as the
    memories read it: M (models/adaptation/_adapter_memory.py) unless the "session" section's "adapter" is false,
    the output rows' delta (_head_memory.py) where a "head" section gives its settings."""
    session = dyneval.get("session")
    adapter = session.get("adapter", True) if isinstance(session, Mapping) else True
    return tuple(name for name, on in (("adapter", adapter is not False), ("head", bool(dyneval.get("head")))) if on)


@functools.cache
def checkpoint_learned(path: str) -> tuple[str, ...]:
    """`default_learned` of the checkpoint at `path` now; the default checkpoint's where `path` is not one."""
    try:
        return default_learned(json.loads((Path(path) / "dyneval.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return default_learned(json.loads((DEFAULT_CHECKPOINT / "dyneval.json").read_text(encoding="utf-8")))


def refusal(system: str, ckpt: CheckpointInfo) -> str | None:
    """Why `system` cannot measure `ckpt` (None: it can)."""
    if ckpt.tokenizer == "bytes" or system.startswith("presage") or system in WORD_SYSTEMS:
        return None
    if system.startswith("full"):
        return ("it runs the byte-level word search in this process (models/keysim.py); a word model is measured "
                "through its server (static, sparse)")
    return "it leaves out the session's copy model, which a word model does not have: the row would be 'sparse' again"


def choose_systems(given: str | None, ckpt: CheckpointInfo) -> tuple[list[str], dict[str, str]]:
    """The systems to run, from --systems (None: all that `ckpt` can run) -> (systems, {left out: why}). Raises
    ValueError for an unknown system, or one asked for by name that cannot measure `ckpt`."""
    asked = [s for s in (given or ",".join(SYSTEMS)).split(",") if s]
    unknown = [s for s in asked if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    why = {s: reason for s in asked if (reason := refusal(s, ckpt)) is not None}
    if why and given is not None:
        raise ValueError("; ".join(f"--systems {s} cannot measure {ckpt.name} (tokenizer {ckpt.tokenizer!r}): "
                                   f"{reason}" for s, reason in why.items()))
    return [s for s in asked if s not in why], why


def result_path(out: Path, name: str, system: str, tag: str | None) -> Path:
    """OUT/<text>.<system>.json for Presage and the default checkpoint; OUT/<text>.<system>@<tag>.json for our
    systems on another checkpoint."""
    if tag is None or system.startswith("presage"):
        return out / f"{name}.{system}.json"
    return out / f"{name}.{system}@{tag}.json"


# -- the runs --------------------------------------------------------------------------------------------------


def run_one(name: str, system: str, warm: str, measured: str, args: argparse.Namespace,
            ckpt: CheckpointInfo) -> dict[str, Any]:
    record: dict[str, Any] = {"text": name, "system": system, "measured_bytes": len(measured.encode("utf-8")),
                              "warmup_bytes": len(warm.encode("utf-8"))}
    if not system.startswith("presage"):
        record.update({"checkpoint": ckpt.name, "checkpoint_path": str(ckpt.path), "tokenizer": ckpt.tokenizer})
    t0 = time.perf_counter()

    def progress(result: KeysimResult) -> None:
        if result.messages % 100 == 0:
            print(f"  {name}/{system}: {result.messages} messages, {result.chars:,} chars, KSR {result.ksr:.4f}, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    if system.startswith("presage"):
        learn = system == "presage-learn"
        db = build_presage_db(args.db)
        config = presage_config(args.out, db, learn, f"{name}.{system}")
        suggester = PresageSuggester(config, learn)
        try:
            result = simulate(suggester, messages(measured), k=K, warmup=messages(warm), on_message=progress)
        finally:
            suggester.close()
        sim_config = presage_config(args.out, db, learn, f"{name}.{system}.simulator")
        record["presage_simulator_ksr"] = presage_simulator_ksr(sim_config, measured, args.out)
    elif system.startswith("full"):
        from models.checkpoint import load_checkpoint
        from models.keysim import ModelSuggester
        from trainer.evaluation import config_for

        loaded = load_checkpoint(ckpt.path)
        config = config_for("dynamic", loaded.dyneval)
        from models.copymodel import CopyModel

        cache = loaded.dyneval.cache_weight if system in ("full-cache", "full-copy") else 0.0
        copy = CopyModel(loaded.dyneval.copy) if system == "full-copy" and loaded.dyneval.copy is not None else None
        record.update({"lr": config.lr, "decay": config.decay, "rule": config.rule, "cache_weight": cache,
                       "copy": copy is not None})
        suggester = ModelSuggester(loaded.model, config, stats=loaded.stats, cache_weight=cache, copy=copy,
                                   lexicon=loaded.lexicon)
        result = simulate(suggester, messages(measured), k=K, warmup=messages(warm), on_message=progress)
    else:
        # static: lr 0 (the head then off, M at rate 0), no word cache, no neural cache; the sessions: the defaults
        lr, cache = {"static": (0.0, 0.0), "sparse": (None, None), "sparse-nocache": (None, 0.0),
                     "sparse-nocopy": (None, None), "sparse-noneural": (None, None)}[system]
        # the neural cache: off for the static row and sparse-noneural, else the checkpoint's default
        neural_cache = False if system in ("static", "sparse-noneural") else None
        at = "" if ckpt.tag is None else f"@{ckpt.tag}"
        log = args.out / f"{name}.{system}{at}.server.log"
        checkpoint = ckpt.path
        if system in ("static", "sparse-nocopy"):  # the session without its copy model
            checkpoint = without_copy(ckpt.path, args.out / f"checkpoint-nocopy-{name}-{system}{at}")
        budget = args.suggest_budget_ms
        with serve(str(checkpoint), log, suggest_budget_ms=budget) as url, Client(url, timeout=600) as client, \
                SessionSuggester(client, lr=lr, cache_weight=cache, neural_cache=neural_cache) as suggester:
            info = suggester.session.info
            assert info is not None
            neural = info.adaptation.neural_cache  # a session with the neural cache has no copy model
            record.update({"learned": [m for m in LEARNED if m in info.adaptation.memories],
                           "lr": info.adaptation.lr, "decay": info.adaptation.decay,
                           "cache_weight": info.adaptation.cache_weight, "neural_cache": neural,
                           "copy": ckpt.copy and checkpoint == ckpt.path and not neural,
                           "suggest_budget_ms": budget})
            cut0 = suggest_cut(url)
            result = simulate(suggester, messages(measured), k=K, warmup=messages(warm), on_message=progress)
            # suggestions the budget cut short: their completions are what the search had found by then
            record["suggest_cut"] = (suggest_cut(url) - cut0) / max(len(result.latencies_s), 1)
    record.update(result.summary())
    record["seconds"] = time.perf_counter() - t0
    return record


def without_copy(checkpoint: Path, out: Path) -> Path:
    """A copy of `checkpoint` whose dyneval.json has no "copy" section: its sessions run without the copy model."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(checkpoint, out)
    dyneval = json.loads((out / "dyneval.json").read_text())
    dyneval.pop("copy", None)
    (out / "dyneval.json").write_text(json.dumps(dyneval, indent=2))
    return out


SESSION_VARIANT = {"sparse": "as served", "sparse-nocache": "without the word cache",
                   "sparse-nocopy": "without the copy model", "sparse-noneural": "without the neural cache"}


def row_label(system: str, r: dict[str, Any], checkpoint: str | None) -> str:
    """The table's name of a result `r` of `system`; `checkpoint`: the name our rows carry (None: none).

    A session's or full dynamic evaluation's parts are named from what the record says ran (its "learned", "copy",
    "neural_cache" and "cache_weight"), not from the system's name: a checkpoint without a copy section (the
    transformers) runs "sparse" without one. A record written before records kept "learned" names what its
    checkpoint's sessions learn by default now (`checkpoint_learned`); one written before they kept "copy" gets the
    system's name."""
    label = SYSTEMS[system]
    words = r.get("tokenizer", "bytes") != "bytes"
    parts = (["copy model"] if r.get("copy") else []) + (["neural cache"] if r.get("neural_cache") else []) + \
        (["word cache"] if r.get("cache_weight") else [])
    if system in SESSION_VARIANT and ("copy" in r or words):  # a word model's records never have a copy model
        learned = r.get("learned")
        if learned is None:
            learned = checkpoint_learned(str(r.get("checkpoint_path") or DEFAULT_CHECKPOINT))
        label = f"ours, session {SESSION_VARIANT[system]}: {' + '.join([*learned, *parts]) or 'nothing'} (HTTP)"
    elif system.startswith("full") and "copy" in r:
        label = f"ours, full dynamic evaluation{''.join(f' + {p}' for p in parts)} (in-process)"
    if checkpoint is not None and not system.startswith("presage"):
        label = label.replace("ours", f"ours ({checkpoint}{', word model' if words else ''})", 1)
    if system != "static" and r.get("lr"):
        label += f" (lr {r['lr']:g})" if words else f" (lr {r['lr']:g}, cache {r.get('cache_weight', 0):g})"
    return label


def table(out: Path, names: list[str]) -> None:
    rows = []
    for name in names:
        # the default checkpoint's results, then each other checkpoint's present in OUT (named after it)
        tags = sorted({p.stem.rsplit("@", 1)[1] for p in out.glob(f"{name}.*@*.json")})
        for tag in [None, *tags]:
            for system in SYSTEMS:
                path = result_path(out, name, system, tag)
                if (tag is not None and system.startswith("presage")) or not path.exists():
                    continue
                r = json.loads(path.read_text())
                # a table of one checkpoint reads as before; with several, every row of ours names its own
                label = row_label(system, r, (tag or "default") if tags else None)
                sim = r.get("presage_simulator_ksr")
                rows.append(f"| {TEXTS[name][0]} | {label} | {r['measured_bytes']:,} | {r['warmup_bytes']:,} "
                            f"| {r['ksr']:.3f} | {r['top1_accuracy']:.3f} | {r['top3_accuracy']:.3f} "
                            f"| {r['suggest_ms_p50']:.1f} | {r['suggest_ms_p99']:.1f} "
                            f"| {'' if sim is None else f'{sim:.3f}'} |")
    print("| text | system | bytes typed | warm-up bytes | KSR | top-1 | top-3 | suggest p50 ms | suggest p99 ms "
          "| presage_simulator KSR |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                    help="our systems' checkpoint (default: checkpoints/default); a word model runs static and sparse")
    ap.add_argument("--texts", default=",".join(TEXTS))
    ap.add_argument("--systems", help=f"comma list (default: every one the checkpoint can run): {', '.join(SYSTEMS)}")
    ap.add_argument("--limit-bytes", type=int, help="type only the first N bytes of each measured part")
    ap.add_argument("--warmup-bytes", type=int,
                    help="observe at most the N bytes before the measured part (default: all of them)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "keyboard")
    ap.add_argument("--db", type=Path, default=ROOT / "runs" / "keyboard" / "presage-train.db",
                    help="Presage's n-gram database (built there from the training text if missing)")
    ap.add_argument("--suggest-budget-ms", type=float, default=0.0,
                    help="the servers' ADAPTLM_SUGGEST_BUDGET_MS for the HTTP rows (default 0: exact searches, as the "
                    "in-process rows; the served default, 50, cuts searches on a busy machine, so KSR then depends "
                    "on the load)")
    ap.add_argument("--force", action="store_true", help="run again what OUT already has")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    try:
        ckpt = inspect_checkpoint(args.checkpoint)
    except (OSError, ValueError) as e:
        ap.error(f"--checkpoint {args.checkpoint}: not a checkpoint ({e})")
    try:
        systems, skipped = choose_systems(args.systems, ckpt)
    except ValueError as e:
        ap.error(str(e))
    names = [t for t in args.texts.split(",") if t]
    if unknown := [t for t in names if t not in TEXTS]:
        ap.error(f"unknown text(s) {', '.join(unknown)}; known: {', '.join(TEXTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"# keyboard suggestions, k={K}, {ckpt.name}: {machine_line()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    if not args.table_only:
        for system, reason in skipped.items():
            print(f"skipping {system} on {ckpt.name} (tokenizer {ckpt.tokenizer!r}): {reason}", file=sys.stderr)
        for name in names:
            label, rel, last = TEXTS[name]
            warm, measured = split_text(data_file(rel).read_bytes(), last_bytes=last, warmup_bytes=args.warmup_bytes,
                                        limit_bytes=args.limit_bytes)
            for system in systems:
                path = result_path(args.out, name, system, ckpt.tag)
                if path.exists() and not args.force:
                    continue
                print(f"{name}/{system}: typing {len(measured.encode()):,} bytes after {len(warm.encode()):,} "
                      "observed", file=sys.stderr, flush=True)
                record = run_one(name, system, warm, measured, args, ckpt)
                path.write_text(json.dumps(record, indent=1) + "\n")
                print(f"{name}/{system}: KSR {record['ksr']:.4f}, top-3 {record['top3_accuracy']:.4f}, "
                      f"{record['seconds']:.0f} s", file=sys.stderr, flush=True)
    table(args.out, names)


if __name__ == "__main__":
    main()
