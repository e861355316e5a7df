"""The session service: the one place that knows what a session may be on this checkpoint and server.

It fills a session's adaptation settings from the checkpoint's defaults (`SessionLimits`, from dyneval.json)
and checks them and the TTL against the limits (the wire schema only checks fixed facts, such as lr >= 0);
it makes fresh sessions (the initial state after the BOS byte, M = 0) and the template a store reads sessions
back into; it creates, resets, imports and exports sessions against the store; and it keeps the update rules
of the settings in use (built once per (lr, decay, adapter size)). The operations that write sessions run on
the worker thread, in the session's turn; the settings and reads may run anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from models.adaptation import CacheMixed, DynEvalConfig, UpdateRule, sparse_rule
from models.base import Adapter, LanguageModel, State
from models.checkpoint import Checkpoint
from models.copymodel import CopyMixed, CopyModel, empty_view, merge_state
from server.engine._errors import (
    EngineUnavailable,
    InvalidSessionSettings,
    SessionImportError,
    SessionNotFound,
    SessionStoreFull,
    SessionsUnavailable,
)
from server.engine._export import export_session, import_session
from server.engine._loading import SessionLimits
from server.engine._session import AdaptationConfig, Session
from server.engine._store import SessionStore

__all__ = ["SessionService"]

_RULE_CACHE = 256  # update rules kept, by (lr, decay, adapter size)
# The largest learning rate a session may ask for: far above any rate that adapts (the checkpoints' tuned ones are
# 1e-6 to 1e-2), and far below those that overflow (at lr 1e20 an adapter's generations are NaN, a 500)
MAX_SESSION_LR = 1e4


class SessionService:
    def __init__(self, store: SessionStore, *, ttl_s: float, max_ttl_s: float, retry_after_s: int) -> None:
        self.store = store
        self._ttl_s, self._max_ttl_s, self._retry_after_s = ttl_s, max_ttl_s, retry_after_s
        self._ckpt: Checkpoint | None = None
        self._limits: SessionLimits | None = None
        self._why = ""
        self.base: DynEvalConfig | None = None  # the checkpoint's sparse settings, which the rules derive from
        self.copy_model: CopyModel | None = None  # the sessions' copy model, when the checkpoint has one
        self._mixed: LanguageModel | None = None
        self._mixed_base: LanguageModel | None = None
        self._rules: dict[tuple[float, float, int], UpdateRule] = {}

    def load(self, ckpt: Checkpoint, limits: SessionLimits | None, why: str, base: DynEvalConfig | None) -> None:
        """The checkpoint is loaded: bind the store to it (the store may restore its sessions now)."""
        self._ckpt, self._limits, self._why, self.base = ckpt, limits, why, base
        # the sessions' copy model: the checkpoint's settings (dyneval.json "copy"), on by default
        config = ckpt.dyneval.copy
        self.copy_model = CopyModel(config, ckpt.tokenizer.vocab_size) if config is not None and limits else None
        if self.copy_model is not None:
            self.copy_model.warm_up(ckpt.device)  # its kernels compile here, not in the first request
        self._mixed = None
        self._hidden = _hidden_size(ckpt) if limits is not None else None
        self.store.bind(ckpt.model_hash, self.template(), ckpt.tokenizer)

    # -- settings --------------------------------------------------------------------------------------

    def session_model(self) -> LanguageModel:
        """The model that sampling and the keyboard search run (one object, so that all generations batch): the
        network, mixed with each session's copy model when sessions have one, and with each session's neural cache
        when it has one (a row without either gets the network alone)."""
        model = self._checkpoint().model
        if self._mixed is None or self._mixed_base is not model:
            inner: LanguageModel = CopyMixed(model, self.copy_model) if self.copy_model is not None else model
            self._mixed = CacheMixed(inner, self._limits.cache) if self._limits is not None else inner
            self._mixed_base = model
        return self._mixed

    def view_state(self, session: Session) -> State:
        """The state sampling and the keyboard search continue `session` from (`Session.view_state`). Where sessions
        have a copy model and this one has none (turned off, or a neural cache in its place), with the empty view of
        one: its rows then batch with the others' (their states hold the same tensors) and read the network alone."""
        if session.copy is None and self.copy_model is not None:
            return merge_state(session.state, empty_view(1, session.state.batch_device()))
        return session.view_state()

    def limits(self) -> SessionLimits:
        """The checkpoint's session settings; raises SessionsUnavailable if it cannot adapt sessions."""
        if self._ckpt is None:
            raise EngineUnavailable("the engine has not loaded a model")
        if self._limits is None:
            raise SessionsUnavailable(self._why)
        return self._limits

    def config(self, *, lr: float | None = None, decay: float | None = None, adapter_size: int | None = None,
               cache_weight: float | None = None, neural_cache: bool | None = None,
               copy_model: bool | None = None) -> AdaptationConfig:
        """The checkpoint's defaults for what is None, checked (InvalidSessionSettings)."""
        default = self._defaults()
        return self.check(AdaptationConfig(
            lr=default.lr if lr is None else lr, decay=default.decay if decay is None else decay,
            adapter_size=default.adapter_size if adapter_size is None else adapter_size,
            cache_weight=default.cache_weight if cache_weight is None else cache_weight,
            neural_cache=default.neural_cache if neural_cache is None else neural_cache,
            copy_model=default.copy_model if copy_model is None else copy_model))

    def check(self, config: AdaptationConfig) -> AdaptationConfig:
        """`config` if this checkpoint can adapt with it; else InvalidSessionSettings."""
        limits = self.limits()
        if config.adapter_size < 1:
            raise InvalidSessionSettings("Input should be greater than or equal to 1", param="adapter_size",
                                         code="greater_than_equal")
        if config.adapter_size > limits.max_adapter_size:
            raise _over(limits.max_adapter_size, "adapter_size")
        if not (math.isfinite(config.lr) and config.lr >= 0):
            raise InvalidSessionSettings("Input should be a finite number greater than or equal to 0", param="lr",
                                         code="greater_than_equal")
        if config.lr > MAX_SESSION_LR:
            raise _over(MAX_SESSION_LR, "lr")
        if config.neural_cache and self._hidden is None:
            raise InvalidSessionSettings("this model gives no hidden states for a neural cache", param="neural_cache",
                                         code="unsupported")
        for name in ("decay", "cache_weight"):
            value = getattr(config, name)
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise InvalidSessionSettings("Input should be a finite number in [0, 1]", param=name,
                                             code="out_of_range")
        return config

    def ttl(self, ttl_s: float | None) -> float:
        """The server's default TTL for None; a TTL above the server's longest raises InvalidSessionSettings."""
        if ttl_s is None:
            return self._ttl_s
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise InvalidSessionSettings("Input should be a finite number greater than 0", param="ttl_s",
                                         code="greater_than")
        if ttl_s > self._max_ttl_s:
            raise _over(self._max_ttl_s, "ttl_s")
        return ttl_s

    def _defaults(self) -> AdaptationConfig:
        limits = self.limits()
        return AdaptationConfig(lr=limits.lr, decay=limits.decay, adapter_size=limits.adapter_size,
                                cache_weight=limits.cache_weight, neural_cache=limits.neural_cache)

    # -- records ---------------------------------------------------------------------------------------

    def _checkpoint(self) -> Checkpoint:
        if self._ckpt is None:
            raise EngineUnavailable("the engine has not loaded a model")
        return self._ckpt

    def fresh(self, session_id: str, owner: str | None, ttl_s: float, config: AdaptationConfig) -> Session:
        """A session at the start: the initial state after the BOS byte, M = 0; a copy model (where the checkpoint
        has one) unless the session turned it off or keeps the neural cache instead (whose memory starts empty)."""
        model = self._checkpoint().model
        ref = next(model.parameters())
        sites = {s.name: config.adapter_size for s in model.adaptation_sites()}
        now = time.time()
        return Session(id=session_id, owner=owner, created=now, last_used=now, ttl_s=ttl_s, config=config,
                       state=model.init_state(1), static_state=model.init_state(1),
                       last_token=self._checkpoint().tokenizer.bos,
                       adapter=Adapter.zeros(sites, 1, dtype=ref.dtype, device=ref.device),
                       copy=self.copy_model.init_state(1, ref.device)
                       if self.copy_model is not None and config.copy_model and not config.neural_cache else None)

    def template(self) -> Session:
        """A fresh session of this model, for a store to read sessions back into (tensor layouts, device; its
        `cache` an empty memory of the neural cache, whose hidden size an import checks against)."""
        fresh = self.fresh("", None, self._ttl_s, AdaptationConfig(lr=0.0, decay=0.0, adapter_size=1))
        return dataclasses.replace(fresh, created=0.0, last_used=0.0, cache=self._empty_cache())

    def _empty_cache(self) -> State | None:
        """A neural cache's memory with no pairs (None: the model gives no hidden states)."""
        if self._hidden is None:
            return None
        ref = next(self._checkpoint().model.parameters())
        return State({"keys": torch.zeros(1, 0, self._hidden, device=ref.device),
                      "values": torch.zeros(1, 0, dtype=torch.long, device=ref.device),
                      "valid": torch.zeros(1, 0, dtype=torch.bool, device=ref.device)})

    def get(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session:
        """The session's last committed record (work in flight is not in it yet)."""
        session = self.store.get(session_id, owner, touch=touch)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    def delete(self, session_id: str, owner: str | None) -> None:
        if not self.store.delete(session_id, owner):
            raise SessionNotFound(session_id)

    def export(self, session_id: str, owner: str | None) -> bytes:
        model_hash = self._checkpoint().model_hash
        return export_session(self.get(session_id, owner), model_hash)

    def create(self, session_id: str, owner: str | None, ttl_s: float, config: AdaptationConfig) -> Session:
        """(Worker.) Store a fresh session. -> the stored record (its revision is what work on it updates)."""
        return self._insert(self.fresh(session_id, owner, ttl_s, config))

    def reset(self, session_id: str, owner: str | None) -> Session:
        """(Worker.) Back to the start, keeping its id, owner, creation time, config and TTL; SessionConflict if
        another server changed it between the read and the write (a reset then would undo that change unseen)."""
        old = self.get(session_id, owner)
        session = dataclasses.replace(self.fresh(session_id, owner, old.ttl_s, old.config), created=old.created,
                                      revision=old.revision)
        stored = self.store.update(session)
        if stored is None:
            raise SessionNotFound(session_id)
        return stored

    def load_export(self, session_id: str, owner: str | None, blob: bytes) -> Session:
        """(Worker.) Create or replace `session_id` from an export; its TTL is cut to the server's longest."""
        if self.store.get(session_id, owner, touch=False) is None and self.store.contains(session_id):
            raise SessionNotFound(session_id)  # another owner's: not ours to replace, nor to reveal
        template = dataclasses.replace(self.fresh(session_id, owner, self._ttl_s, self._defaults()),
                                       cache=self._empty_cache())
        ckpt = self._checkpoint()
        session, config = import_session(blob, model_hash=ckpt.model_hash, template=template,
                                         tokenizer=ckpt.tokenizer)
        session = dataclasses.replace(session, ttl_s=min(session.ttl_s, self._max_ttl_s))
        try:
            self.check(config)
        except InvalidSessionSettings as e:
            raise SessionImportError(f"the export's adaptation settings are refused here: {e.param}: {e}") from None
        return self._insert(session)

    def _insert(self, session: Session) -> Session:
        try:
            return self.store.insert(session)
        except SessionStoreFull as e:
            e.retry_after_s = self._retry_after_s
            raise

    # -- update rules ----------------------------------------------------------------------------------

    def rule(self, config: AdaptationConfig) -> UpdateRule:
        """(Worker.) The update rule of a session's settings: the checkpoint's rule and eps, MS_g of its (k, k)
        block."""
        key = (config.lr, config.decay, config.adapter_size)
        rule = self._rules.get(key)
        if rule is None:
            assert self.base is not None
            ckpt = self._checkpoint()
            cfg = dataclasses.replace(self.base, lr=config.lr, decay=config.decay, adapter_units=config.adapter_size)
            _, rule = sparse_rule(ckpt.model, cfg, ckpt.stats)
            if len(self._rules) >= _RULE_CACHE:
                self._rules.clear()
            self._rules[key] = rule
        return rule


@torch.no_grad()
def _hidden_size(ckpt: Checkpoint) -> int | None:
    """H of the hidden states the model hands the output layer (`Output.hidden`), or None if it gives none."""
    model = ckpt.model
    ref = next(model.parameters())
    out = model(torch.tensor([[ckpt.tokenizer.bos]], device=ref.device), model.init_state(1))
    return int(out.hidden.shape[-1]) if out.hidden is not None else None


def _over(limit: float, param: str) -> InvalidSessionSettings:
    return InvalidSessionSettings(f"Input should be less than or equal to {limit} (this server's limit)",
                                  param=param, code="less_than_equal")
