"""Keyboard suggestions from a model in this process, for the keystroke-savings simulator (`clients.keysim`):
the model reads each finished message and (optionally) adapts on it, like a server session, and suggests words
for the message being typed.

    suggester = ModelSuggester(ckpt.model, DynEvalConfig(mode="full", ...), stats=ckpt.stats)
    suggester.observe("a finished message\\n")      # scored segment by segment, adapting after each
    suggester.suggest("the next mess", k=3)         # -> ['message', 'messages', 'mess']

Modes (`DynEvalConfig.mode`):
- "static": fixed weights; observing only moves the recurrent state on (the text is context);
- "sparse": sparse dynamic evaluation of adapter matrices M (the server's sessions), `sparse_step` per segment;
- "full": full dynamic evaluation of the weights (thesis fig. 4.1, as in `models.adaptation`'s full mode): each
  segment is scored, then one update step of every adapted parameter, continuing across messages from where
  the last one left off; suggestions run through `torch.func.functional_call` with the adapted tensors (the
  shared model's weights are never written).

The text is one stream from the BOS byte, as in a session: `observe` feeds the byte that follows the state and
the text but its last byte, which becomes the next input. A cursor (the model after the message typed so far)
is kept between suggestions, so each keystroke feeds only the characters it added.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import cast

import torch
from torch.func import functional_call

from models.adaptation import DynEvalConfig, UpdateRule, adapted_parameter_names, adapter_ms_g, sparse_step
from models.base import Adapter, LanguageModel, Output, State
from models.scoring import BOS
from models.suggest import Cursor, advance, suggest
from models.wordcache import WordCache

__all__ = ["ModelSuggester"]


class _Bound:
    """The model with some of its parameters replaced, called through `functional_call`: what `models.suggest`
    needs of a model (a call and `parameters()`), for suggestions from fully adapted weights."""

    def __init__(self, model: LanguageModel, params: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.params = params

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self.params.values())

    def __call__(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        return cast(Output, functional_call(self.model, self.params, (tokens, state, adapter)))


class ModelSuggester:
    """Implements `clients.keysim.Suggester` with a model in this process (module docstring). `config` None is
    static; `stats` are the checkpoint's MS_g statistics (the RMS rules need them); `cache_weight` > 0 mixes a
    word cache of the observed text into the completions, as a server session does (`models.wordcache`)."""

    def __init__(self, model: LanguageModel, config: DynEvalConfig | None = None, *,
                 stats: Mapping[str, torch.Tensor] | None = None, max_chars: int = 24,
                 cache_weight: float = 0.0) -> None:
        if not 0 <= cache_weight <= 1:
            raise ValueError(f"cache_weight must be in [0, 1], not {cache_weight}")
        self.model = model.eval()
        self.cache_weight = cache_weight
        self.words = WordCache()
        self.config = config or DynEvalConfig(mode="static")
        self.max_chars = max_chars
        ref = next(model.parameters())
        self.device = ref.device
        self.state = model.init_state(1)
        self.last = BOS
        self.adapter: Adapter | None = None
        self.fed = 0  # bytes fed to the model by suggestions (the cursor cache's work)
        self.updates = 0
        self._cursor: tuple[bytes, Cursor] | None = None  # (context bytes, the model after them)
        mode = self.config.mode
        if mode == "sparse":
            sites = {s.name: self.config.adapter_units or s.dim for s in model.adaptation_sites()}
            ms_g = None
            if self.config.rule in ("rms", "rms_decay"):
                if stats is None:
                    raise ValueError(f"rule {self.config.rule!r} needs the checkpoint's stats")
                ms_g = {k: v.to(ref.device, ref.dtype) for k, v in adapter_ms_g(stats, sites).items()}
            self.adapter = Adapter.zeros(sites, 1, dtype=ref.dtype, device=ref.device)
            self._ms_g = ms_g
            self._rule = UpdateRule(self.config, list(sites), ms_g)
        elif mode == "full":
            names = adapted_parameter_names(model, self.config)
            everything = {n: p.detach() for n, p in model.named_parameters()}
            self._theta_g = {n: everything[n] for n in names}  # the unadapted weights: decay pulls towards them
            self._fixed = {n: p for n, p in everything.items() if n not in self._theta_g}
            ms_g = None
            if stats is not None:
                ms_g = {n: stats[f"param.{n}"].to(ref.device, ref.dtype) for n in names if f"param.{n}" in stats}
            self._rule = UpdateRule(self.config, names, ms_g)
            self.params = {n: p.clone() for n, p in self._theta_g.items()}
        self._bind()

    def _bind(self) -> None:
        self._forward: LanguageModel = self.model if self.config.mode != "full" else cast(
            LanguageModel, _Bound(self.model, {**self._fixed, **self.params}))

    # -- the Suggester protocol ---------------------------------------------------------------------------

    @torch.no_grad()
    def suggest(self, context: str, k: int) -> list[str]:
        data = context.encode("utf-8")
        inputs = bytes([self.last]) + data
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
        found = suggest(self._forward, cursor, context, self.adapter, k=k, max_chars=self.max_chars, n_chars=0)
        completions = self.words.mix(found.completions, context, self.cache_weight, k, self.max_chars)
        return [c.text for c in completions]

    def observe(self, text: str) -> None:
        data = text.encode("utf-8")
        if not data:
            return
        inputs = torch.tensor([self.last, *data[:-1]], dtype=torch.long, device=self.device)  # (T,)
        targets = torch.tensor(list(data), dtype=torch.long, device=self.device)  # (T,)
        mode = self.config.mode
        if mode == "static":
            with torch.no_grad():
                self.state = self.model(inputs.unsqueeze(0), self.state).state
        else:
            n = self.config.segment
            for start in range(0, inputs.numel(), n):
                x, y = inputs[None, start:start + n], targets[None, start:start + n]  # (1, t)
                if mode == "sparse":
                    self._sparse_segment(x, y)
                else:
                    self._full_segment(x, y)
                self.updates += 1
            self._bind()
        self.last = data[-1]
        self._cursor = None
        self.words.observe(text)

    # -- adaptation ----------------------------------------------------------------------------------------

    def _sparse_segment(self, x: torch.Tensor, y: torch.Tensor) -> None:
        assert self.adapter is not None
        mask = torch.ones_like(x, dtype=torch.bool)  # (1, t)
        step = sparse_step(self.model, x, y, mask, self.state, self.adapter, self._ms_g, self.config, rule=self._rule)
        self.state, self.adapter = step.state, step.adapter

    def _full_segment(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Score the segment with the current weights, then one update step (as `models.adaptation`'s full mode,
        whose non-finite guard this keeps: a non-finite state rewinds the segment, non-finite weights alone are
        dropped)."""
        with torch.inference_mode(False), torch.enable_grad():
            leaves = {k: p.detach().requires_grad_(True) for k, p in self.params.items()}
            out = functional_call(self.model, {**self._fixed, **leaves}, (x, self.state))
            lp = torch.log_softmax(out.logits.float(), dim=-1).gather(-1, y.unsqueeze(-1))  # (1, t, 1)
            grads = torch.autograd.grad(-lp.mean(), list(leaves.values()))
        new = self._rule.step({k: p.detach() for k, p in leaves.items()}, dict(zip(leaves, grads, strict=True)),
                              self._theta_g)
        state = out.state.detach()
        state_ok = all(bool(torch.isfinite(t).all()) for t in state.tensors.values())
        if state_ok and all(bool(torch.isfinite(t).all()) for t in new.values()):
            self.params = new
        if state_ok:
            self.state = state
