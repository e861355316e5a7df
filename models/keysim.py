"""Keyboard suggestions from a model in this process, for the keystroke-savings simulator (`clients.keysim`):
the model reads each finished message and (optionally) adapts on it, like a server session, and suggests words
for the message being typed.

    suggester = ModelSuggester(ckpt.model, DynEvalConfig(mode="full", ...), stats=ckpt.stats)
    suggester.observe("a finished message\\n")      # scored segment by segment, adapting after each
    suggester.suggest("the next mess", k=3)         # -> ['message', 'messages', 'mess']

Modes (`DynEvalConfig.mode`):
- "static": fixed weights; observing only moves the recurrent state on (the text is context);
- "sparse": sparse dynamic evaluation of adapter matrices M (the server's sessions): the text runs through
  `models.adaptation.batch_step`, the step the server's engine and offline evaluation run, guard included;
- "full": full dynamic evaluation of the weights (thesis fig. 4.1, `models.adaptation.FullStream`, as offline
  evaluation's full mode): each segment is scored, then one update step of every adapted parameter, continuing
  across messages from where the last one left off, in a private copy of the weights that suggestions then use
  (the shared model's weights are never written).

The text is one stream from the BOS byte, as in a session: `observe` feeds the byte that follows the state and
the text but its last byte, which becomes the next input. A cursor (the model after the message typed so far)
is kept between suggestions, so each keystroke feeds only the characters it added.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from models.adaptation import (
    STATIC_SEGMENT,
    DynEvalConfig,
    FullStream,
    Row,
    RuleCache,
    TextJob,
    batch_step,
    sparse_rule,
)
from models.base import Adapter, LanguageModel, State
from models.copymodel import CopyMixed, CopyModel, branch_view, frozen_stats, merge_state
from models.lexicon import Lexicon
from models.suggest import Cursor, advance, suggest
from models.tokenizer import ByteTokenizer
from models.wordcache import MIX_CANDIDATES, WordCache

__all__ = ["ModelSuggester"]

class ModelSuggester:
    """Implements `clients.keysim.Suggester` with a model in this process (module docstring). `config` None is
    static; `stats` are the checkpoint's MS_g statistics (the RMS rules need them); `cache_weight` > 0 mixes a
    word cache of the observed text into the completions, as a server session does (`models.wordcache`); `lexicon`
    (the checkpoint's, `Checkpoint.lexicon`) ranks them under its dictionary prior, as the server does
    (`models.lexicon`)."""

    def __init__(self, model: LanguageModel, config: DynEvalConfig | None = None, *,
                 stats: Mapping[str, torch.Tensor] | None = None, max_chars: int = 24,
                 cache_weight: float = 0.0, tokenizer: ByteTokenizer | None = None,
                 copy: CopyModel | None = None, lexicon: Lexicon | None = None) -> None:
        if not 0 <= cache_weight <= 1:
            raise ValueError(f"cache_weight must be in [0, 1], not {cache_weight}")
        self.model = model.eval()  # no dropout in what it suggests
        self.tokenizer = tokenizer or ByteTokenizer()
        self.cache_weight = cache_weight
        self.lexicon = lexicon
        self.words = WordCache()
        self.config = config or DynEvalConfig(mode="static")
        self.max_chars = max_chars
        ref = next(model.parameters())
        self.device = ref.device
        self.last = self.tokenizer.bos
        self.fed = 0  # tokens fed to the model by suggestions (the cursor cache's work)
        self._cursor: tuple[bytes, Cursor] | None = None  # (context bytes, the model after them)
        self._full: FullStream | None = None
        self._mixed: CopyMixed | None = None
        self._rules = RuleCache()
        self.copy = copy  # a copy model mixed into scores and suggestions, as a session with one
        self._frozen: tuple[State, State] | None = None  # (copy state, its frozen_stats)
        mode = self.config.mode
        rule = None
        mats = None
        if mode == "sparse":
            sites, rule = sparse_rule(model, self.config, stats)
            mats = {s: torch.zeros(k, k, dtype=ref.dtype, device=ref.device) for s, k in sites.items()}
        elif mode == "full":
            self._full = FullStream(model, self.config, stats, copy)  # a private copy of the weights adapts
        # static and sparse: the stream, as a server session's
        self._row = Row(model.init_state(1), mats, rule, copy=copy.init_state(1, ref.device) if copy else None)

    @property
    def updates(self) -> int:
        return self._full.updates + self._full.skipped if self._full is not None else (
            self._row.updates + self._row.dropped)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Full mode: the adapted weights (a copy); other modes: none."""
        return self._full.adapted() if self._full is not None else {}

    @property
    def _forward(self) -> LanguageModel:
        model = self._full.model if self._full is not None else self.model
        if self.copy is None:
            return model
        if self._mixed is None or self._mixed.base is not model:
            self._mixed = CopyMixed(model, self.copy)
        return self._mixed

    @property
    def _copy_state(self) -> State | None:
        return self._full.copy if self._full is not None else self._row.copy

    @property
    def adapter(self) -> Adapter | None:
        mats = self._row.mats
        copy = self._copy_state
        stats = None
        if copy is not None:  # indexed once per copy state (a learning step makes a new one), not per keystroke
            if self._frozen is None or self._frozen[0] is not copy:
                self._frozen = (copy, frozen_stats(copy))
            stats = self._frozen[1]
        if mats is None:
            return Adapter({}, copy=stats) if stats is not None else None
        return Adapter({s: m.unsqueeze(0) for s, m in mats.items()}, copy=stats)

    @property
    def state(self) -> State:
        state = self._full.state if self._full is not None else self._row.state
        copy = self._copy_state
        return merge_state(state, branch_view(copy)) if copy is not None else state

    # -- the Suggester protocol ---------------------------------------------------------------------------

    @torch.no_grad()
    def suggest(self, context: str, k: int) -> list[str]:
        data = context.encode("utf-8")
        inputs = self.tokenizer.token_bytes(self.last) + data
        if self._cursor is not None and inputs.startswith(self._cursor[0]) and len(inputs) > len(self._cursor[0]):
            base, cursor = self._cursor
            cursor = advance(self._forward, cursor.state, inputs[len(base):], self.adapter)
            self.fed += len(inputs) - len(base)
        elif self._cursor is not None and inputs == self._cursor[0]:
            cursor = self._cursor[1]
        else:
            cursor = advance(self._forward, self.state, inputs, self.adapter)
            self.fed += len(inputs)
        self._cursor = (inputs, cursor)
        width = max(k, MIX_CANDIDATES) if self.cache_weight > 0 else k  # as a session (server/engine/_suggest.py)
        found = suggest(self._forward, cursor, context, self.adapter, k=width, max_chars=self.max_chars, n_chars=0,
                        tokenizer=self.tokenizer)
        completions = self.words.mix(found.completions, context, self.cache_weight, k, self.max_chars, self.lexicon,
                                     found.space_share)
        return [" " + c.text if c.space_before else c.text for c in completions]  # as inserted (`Suggester`)

    def observe(self, text: str) -> None:
        data = text.encode("utf-8")
        if not data:
            return
        inputs, targets = self.tokenizer.stream(data, self.last, self.device)  # (T,)
        if self._full is not None:
            n = self.config.segment
            for start in range(0, inputs.numel(), n):
                self._full.step(inputs[None, start:start + n], targets[None, start:start + n])
        else:
            job = TextJob(inputs, targets, [self._row])
            segment = self.config.segment if self.config.mode == "sparse" else STATIC_SEGMENT
            while not job.done:
                batch_step(self.model, [job], segment, self._rules, self.copy)
            self._row.logprobs.clear()  # only the stream's state and adapter are kept
        self.last = self.tokenizer.last_token(data)
        self._cursor = None
        self.words.observe(text)
