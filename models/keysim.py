"""Keyboard suggestions from a model in this process, for the keystroke-savings simulator (`adaptlm_client.keysim`):
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

import dataclasses
from collections.abc import Mapping

import torch

from models.adaptation import STATIC_SEGMENT, AdapterMemory, DynEvalConfig, FullStream, sparse_sites
from models.base import Adapter, LanguageModel, State
from models.copymodel import CopyMemory, CopyModel, branch_view, frozen_stats
from models.lexicon import Lexicon
from models.memory import Memory, MemoryMixed, MemorySettingsError, merge_branches
from models.session import SessionModel
from models.suggest import Cursor, advance, suggest
from models.tokenizer import ByteTokenizer, Tokenizer, byte_level, word_level
from models.word_suggest import word_suggestions
from models.word_tokenizer import WordTokenizer
from models.wordcache import WordsMemory

__all__ = ["ModelSuggester"]


class ModelSuggester:
    """Implements `adaptlm_client.keysim.Suggester` with a model in this process (module docstring). `config` None is
    static; `stats` are the checkpoint's MS_g statistics (the RMS rules need them); `cache_weight` > 0 mixes a
    word cache of the observed text into the completions, as a server session does (`models.wordcache`); `lexicon`
    (the checkpoint's, `Checkpoint.lexicon`) ranks them under its dictionary prior, as the server does
    (`models.lexicon`). Static and sparse modes run the server's session (`models.session`)."""

    def __init__(self, model: LanguageModel, config: DynEvalConfig | None = None, *,
                 stats: Mapping[str, torch.Tensor] | None = None, max_chars: int = 24,
                 cache_weight: float = 0.0, tokenizer: Tokenizer | None = None,
                 copy: CopyModel | None = None, lexicon: Lexicon | None = None,
                 sessions: SessionModel | None = None,
                 settings: Mapping[str, Mapping[str, object] | None] | None = None) -> None:
        """With `sessions` (a checkpoint's: `SessionModel.of(ckpt)`), the simulator runs a session of it with
        `settings` (`SessionModel.config`), as its server would; `config`, `copy` and `cache_weight` are then not
        read."""
        self.model = model.eval()  # no dropout in what it suggests
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.lexicon = lexicon
        self.config = config or DynEvalConfig(mode="static")
        self.max_chars = max_chars
        ref = next(model.parameters())
        self.device = ref.device
        self.fed = 0  # tokens fed to the model by suggestions (the cursor cache's work)
        self._cursor: tuple[bytes, Cursor] | None = None  # (context bytes, the model after them)
        self._full: FullStream | None = None
        self._mixed: MemoryMixed | None = None
        self.copy = copy  # a copy model mixed into scores and suggestions, as a session with one
        self._frozen: tuple[State, State] | None = None  # full mode: (copy state, its frozen_stats)
        if sessions is not None:
            self.sessions = sessions
            self.session = sessions.fresh(sessions.config(settings))
            return
        memories: dict[str, Memory] = {}
        asked: dict[str, dict[str, object] | None] = {"words": {"weight": cache_weight}}
        mode = self.config.mode
        segment = STATIC_SEGMENT
        if mode == "sparse":
            sites = sparse_sites(model, self.config.adapter_units)
            size = max(sites.values())
            memories["adapter"] = AdapterMemory(model, stats, self.config, size, size)
            segment = self.config.segment
        elif mode == "full":
            if isinstance(self.tokenizer, WordTokenizer):
                raise ValueError("full dynamic evaluation of a word model's suggestions is not simulated: adapt "
                                 "sparsely, as its server sessions do")
            self._full = FullStream(model, self.config, stats, copy)  # a private copy of the weights adapts
        if copy is not None and mode != "full":
            memories["copy"] = CopyMemory(copy)
        memories["words"] = WordsMemory()
        self.sessions = SessionModel(model, self.tokenizer, memories, segment)
        try:
            resolved = self.sessions.config(asked)
        except MemorySettingsError as e:  # the refused setting under this class's name for it
            raise ValueError(f"cache_weight={cache_weight}: {e}") from None
        self.session = self.sessions.fresh(resolved)

    @property
    def words(self) -> object:
        return self.session.memories["words"]

    @property
    def last(self) -> int:
        return self.session.last_token

    @property
    def updates(self) -> int:
        if self._full is not None:
            return self._full.updates + self._full.skipped
        return self.session.stats.updates + self.session.stats.nonfinite_resets

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """Full mode: the adapted weights (a copy); other modes: none."""
        return self._full.adapted() if self._full is not None else {}

    @property
    def _forward(self) -> LanguageModel:
        if self._full is None:
            return self.sessions.search_model
        if self.copy is None:
            return self._full.model
        if self._mixed is None or self._mixed.base is not self._full.model:
            self._mixed = MemoryMixed(self._full.model, [CopyMemory(self.copy)])
        return self._mixed

    @property
    def adapter(self) -> Adapter | None:
        if self._full is None:
            adapter = self.sessions.adapter(self.session)
            return adapter if adapter.mats or adapter.memories else None
        copy = self._full.copy
        if copy is None:
            return None
        if self._frozen is None or self._frozen[0] is not copy:  # indexed once per copy state, not per keystroke
            self._frozen = (copy, frozen_stats(copy))
        return Adapter({}, {"copy": ([self._frozen[1]], None)})

    @property
    def state(self) -> State:
        if self._full is None:
            return self.sessions.view_state(self.session)
        copy = self._full.copy
        return merge_branches(self._full.state, {"copy": branch_view(copy)}) if copy is not None else self._full.state

    # -- the Suggester protocol ---------------------------------------------------------------------------

    @torch.no_grad()
    def suggest(self, context: str, k: int) -> list[str]:
        words = word_level(self.tokenizer)
        if words is not None:  # one model step from the session: the server's word search
            found = word_suggestions(self.sessions.search_model, words, self.session, context, k=k,
                                     n_chars=0, max_chars=self.max_chars, sessions=self.sessions)
            return [" " + c.text if c.space_before else c.text for c in found.completions]
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
        width = self.sessions.search_width(self.session, k)  # as a server session's
        found = suggest(self._forward, cursor, context, self.adapter, k=width, max_chars=self.max_chars, n_chars=0,
                        tokenizer=byte_level(self.tokenizer))  # as the server's search reads it
        completions = self.sessions.rank(self.session, found.completions, context, k, self.max_chars, self.lexicon,
                                         found.space_share)
        return [" " + c.text if c.space_before else c.text for c in completions]  # as inserted (`Suggester`)

    def observe(self, text: str) -> None:
        data = text.encode("utf-8")
        if not data:
            return
        if self._full is not None:
            inputs, targets = self.tokenizer.stream(data, self.last, self.device)  # (T,)
            n = self.config.segment
            for start in range(0, inputs.numel(), n):
                self._full.step(inputs[None, start:start + n], targets[None, start:start + n])
            words = self.sessions.memories["words"].observe_text(self.session.memories["words"], text)
            self.session = dataclasses.replace(self.session, last_token=self.tokenizer.last_token(data),
                                               memories={**self.session.memories, "words": words})
        else:
            self.session = self.sessions.observe(self.session, data, shadow=False)
        self._cursor = None
