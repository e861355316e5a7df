"""Per-session memories: what a session learns from its user's text, each a component behind one interface.

A session (models/session.py) is the network's recurrent state plus named memories, each of one kind:

- ``network``: acts inside the network's forward, as the sparse adapter M of h' = h + M h (docs/algorithms.md,
  "Sparse dynamic evaluation"); it learns by the gradient step of `models.adaptation.batch_step`;
- ``distribution``: mixed into the next-token distribution after the network (the copy model, the neural cache);
  it learns from each scored segment (`learn`) and is read without change by searches and sampling (`read`);
- ``words``: ranks whole-word suggestions (the word cache); it learns from the observed text (`observe_text`).

A memory is a `Memory` subclass registered by name (`register`). For a loaded checkpoint, `build_memories` makes
each registered memory that the checkpoint can serve (`Memory.build`: None where it cannot), and each gives its
default settings there (`Memory.defaults`: None when a session has it only on request). A session's settings are
one mapping name -> settings (`SessionConfig`); its record carries one mapping name -> state. Batching, the
search's `MemoryMixed`, export and import, the session stores and the settings on the wire iterate over these
mappings, so a new memory is one file that subclasses `Memory` and calls `register`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from models.base import ROOT, Adapter, LanguageModel, Output, Site, State

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

__all__ = ["MEMORY_PREFIX_SEP", "RESTORED_LIMIT", "RESTORED_MAX_COUNT", "Learned", "Memory", "MemoryMixed",
           "MemorySettings", "MemorySettingsError", "NoSettings", "SessionConfig", "build_memories", "check_restored",
           "check_values", "memory_types", "merge_branches", "register", "split_branches", "state_nbytes",
           "unregister", "weight_learner"]

Kind = Literal["network", "distribution", "words"]
MEMORY_PREFIX_SEP = "."  # a memory's tensors in an export, and its branch state in a search row: "<name>.<tensor>"

# The modules whose import registers the shipped memories. The registry loads them on first use, so that a
# memory's module may import models/ freely (no cycle through this one).
# The output rows' delta comes before the copy model: it changes the network's distribution, which the others mix into.
_BUILTIN = ("models.adaptation._adapter_memory", "models.adaptation._head_memory", "models.copymodel",
            "models.adaptation._cache", "models.wordcache")
_REGISTRY: dict[str, type[Memory]] = {}
_loaded = False

# The largest magnitude a restored float may have: an export is user input. The shipped models' sessions stay four
# orders below it (after 6 KB of a book: an LSTM cell state of 120, attention keys and memories under 20, adapters
# under 0.1), and float32 arithmetic on such values stays finite (a product of two is under 1e12, a sum of a
# million of those under 1e18, against float32's 3.4e38).
RESTORED_LIMIT = 1e6
RESTORED_MAX_COUNT = 1 << 53  # a restored count (or sum of bits): beyond it, no exact float (10**400: none at all)


class MemorySettings(BaseModel):
    """A memory's per-session settings: validated on construction (ranges in `Field`s), immutable, and what the
    wire and exports carry (`model_dump`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class NoSettings(MemorySettings):
    """A memory a session only turns on or off."""


class MemorySettingsError(ValueError):
    """A setting refused: `param` is its path under the memory ("size"; "" for the memory as a whole), `code` a
    machine-readable reason (pydantic's, or "unsupported", "less_than_equal")."""

    def __init__(self, message: str, *, memory: str, param: str = "", code: str = "invalid") -> None:
        super().__init__(message)
        self.memory, self.param, self.code = memory, param, code


class Learned(NamedTuple):
    """What a distribution memory's `learn` gives back for a segment of B rows."""

    log_dist: torch.Tensor  # (B, T, V) log p of the mixture
    states: list[Any]  # each row's state after its segment
    # (B, 3) integers, per row: weight updates applied, updates the non-finite guard refused, resets by the
    # divergence guard (a session's `updates` and `nonfinite_resets` count them; they stay where they are made until
    # the counts are read, `Row.updates`); None: it takes no weight steps
    steps: torch.Tensor | None = None


class Memory:
    """One kind of per-session memory (module docstring). States are batch-1 objects the memory defines: a `State`
    of tensors, None, or any object with an `nbytes`; they are never changed in place (learning returns new ones)."""

    name: ClassVar[str]
    kind: ClassVar[Kind]
    settings_type: ClassVar[type[MemorySettings]] = NoSettings
    replaces: ClassVar[tuple[str, ...]] = ()  # memories a session drops when this one is on (one remembers its text)
    needs_hidden: ClassVar[bool] = False  # `learn`/`read` need the network's final hidden states (Output.hidden)
    # it learns weights by gradient steps (the adapter M, the output rows' delta): the session API's flat `lr` and
    # `decay` name the checkpoint's default one (`weight_learner`)
    learns_weights: ClassVar[bool] = False

    @classmethod
    def build(cls, ckpt: Checkpoint) -> Memory | None:
        """This memory for a loaded checkpoint's sessions; None where the checkpoint cannot serve it."""
        return cls()

    def defaults(self) -> MemorySettings | None:
        """A new session's settings unless it says otherwise; None: off unless the session asks for it."""
        return None

    def initial_settings(self) -> MemorySettings | None:
        """What `settings` starts from: the defaults (None: the settings type's own)."""
        return self.defaults()

    def settings(self, given: Mapping[str, Any] | None = None) -> MemorySettings:
        """The initial settings updated with `given`, validated; MemorySettingsError if refused."""
        base = self.initial_settings()
        values = {**(base.model_dump() if base is not None else {}), **(given or {})}
        try:
            settings = self.settings_type.model_validate(values)
        except ValidationError as e:
            first = e.errors()[0]
            raise MemorySettingsError(first["msg"], memory=self.name,
                                      param=".".join(str(p) for p in first["loc"]), code=first["type"]) from None
        self.check(settings)
        return settings

    def check(self, settings: MemorySettings) -> None:
        """Limits of this checkpoint beyond the settings' own ranges (MemorySettingsError). None here."""

    def init(self, settings: MemorySettings, device: torch.device) -> Any:
        """A new session's state."""
        raise NotImplementedError


    def export(self, state: Any) -> tuple[dict[str, torch.Tensor], Any]:
        """(tensors, JSON-able metadata) of a state, for an export blob; the tensors are named without prefix."""
        if state is None:
            return {}, None
        return ({k: v.detach().to("cpu").contiguous() for k, v in state.tensors.items()}, None)

    def restore(self, settings: MemorySettings, tensors: dict[str, torch.Tensor], meta: Any,
                device: torch.device) -> Any:
        """The inverse of `export`, validated: an export is user input (ValueError, with what is wrong)."""
        raise NotImplementedError

    def flat(self, state: Any) -> State | None:
        """Its state as batch-1 tensors for `batch_step`'s distribution step (None: empty)."""
        return state if isinstance(state, State) or state is None else None

    # -- distribution memories ---------------------------------------------------------------------------------

    def learn(self, log_dist: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              hidden: torch.Tensor | None, states: Sequence[Any]) -> Learned:
        """Score and learn one segment of B rows: log_dist (B, T, V) the distribution so far, inputs and targets
        (B, T), mask (B, T) True on each row's prefix, hidden (B, T, H) or None, states one per row -> (log p of
        the mixture (B, T, V) float32, float64 for a float64 network, each row's state after its segment, the rows'
        weight steps where it takes any). Padding changes nothing."""
        raise NotImplementedError

    def view(self, state: Any) -> Any:
        """What `read` takes of a session's state (an index built once per record, shared by every search row)."""
        return state

    def branch_state(self, state: Any, batch: int, device: torch.device) -> State | None:
        """Per-row state a search row carries beside the network's (the copy model's last bytes read), for rows of
        a session whose state is `state` (None: a session without this memory); None: this memory needs none."""
        return None

    def read(self, log_dist: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor | None,
             branch: State | None, views: Sequence[Any], index: torch.Tensor) -> tuple[torch.Tensor, State | None]:
        """Mix without learning: row b reads `views[index[b]]` (-1: none, the row keeps log_dist). log_dist
        (B, T, V) float32, tokens (B, T), index (B,) on the host or the device -> (log p (B, T, V), the rows' branch
        states after the tokens)."""
        raise NotImplementedError

    def warm_up(self, device: torch.device) -> None:
        """Run once at load, so that compilation happens then rather than in the first request. Nothing here."""

    # -- words memories ---------------------------------------------------------------------------------------

    def observe_text(self, state: Any, text: str) -> Any:
        """The state after the session observed `text` (a new object)."""
        raise NotImplementedError

    def search_width(self, settings: MemorySettings, k: int) -> int:
        """Words the model's search should find for this memory to rank k of them."""
        return k

    def rank(self, state: Any, settings: MemorySettings, completions: list[Any], context: str, k: int,
             max_chars: int, lexicon: Any, space: float) -> list[Any]:
        """The k best of the model's `completions` of the word being typed at the end of `context`, with this
        memory's words mixed in."""
        raise NotImplementedError


def check_values(name: str, t: torch.Tensor, limit: float = RESTORED_LIMIT) -> None:
    """ValueError unless a restored floating tensor is finite and within +-limit (other dtypes pass)."""
    if t.is_floating_point() and t.numel() and not bool((t.abs() <= limit).all()):  # NaN compares False
        raise ValueError(f"{name} holds values that are not finite or beyond +-{limit:g}")


def check_restored(what: str, tensors: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor],
                   limits: Mapping[str, float] | None = None) -> None:
    """ValueError unless restored `tensors` are exactly `like`'s names, each of its full shape and dtype, floats
    within `check_values`' range (`limits` per name where it differs). A tensor of another shape, batch dimension
    included, would be read out of bounds by a kernel; a value no session makes, overflow the model's arithmetic."""
    unexpected = sorted(set(tensors) - set(like))
    if unexpected:
        raise ValueError(f"unexpected tensors: {', '.join(f'{what}.{k}' for k in unexpected[:5])}")
    for k, ref in like.items():
        t = tensors.get(k)
        if t is None or t.shape != ref.shape or t.dtype != ref.dtype:
            raise ValueError(f"{what}.{k} is missing or not of shape {tuple(ref.shape)} and dtype {ref.dtype} "
                             "(another model?)")
        check_values(f"{what}.{k}", t, (limits or {}).get(k, RESTORED_LIMIT))


def state_nbytes(state: Any) -> int:
    """Bytes a memory's state holds: a `State`'s tensors, None nothing, any other object its `nbytes`."""
    if state is None:
        return 0
    if isinstance(state, State):
        return int(sum(t.numel() * t.element_size() for t in state.tensors.values()))
    return int(state.nbytes)


def register(memory: type[Memory]) -> type[Memory]:
    """Add a memory type to the registry under its `name` (a class decorator; registering a name again replaces
    the entry, so that a test may register its own)."""
    if not memory.name.isidentifier():
        raise ValueError(f"a memory's name must be an identifier, not {memory.name!r}")
    _REGISTRY[memory.name] = memory
    return memory


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def memory_types() -> dict[str, type[Memory]]:
    """The registered memory types by name, in registration order (the shipped ones first)."""
    global _loaded
    if not _loaded:
        for module in _BUILTIN:
            importlib.import_module(module)
        _loaded = True
    shipped = {m: i for i, m in enumerate(_BUILTIN)}
    return dict(sorted(_REGISTRY.items(), key=lambda kv: shipped.get(kv[1].__module__, len(shipped))))


def weight_learner(memories: Mapping[str, Memory]) -> str | None:
    """The memory a session's flat `lr` and `decay` name: the first that learns weights and is on by default, else
    the first that learns weights (None: none does). M where it is on, the output rows' delta where it replaces M."""
    learners = [name for name, m in memories.items() if m.learns_weights]
    on = [name for name in learners if memories[name].defaults() is not None]
    return next(iter(on or learners), None)


def build_memories(ckpt: Checkpoint) -> dict[str, Memory]:
    """Every registered memory the checkpoint can serve, by name, in registration order."""
    out = {}
    for name, memory_type in memory_types().items():
        memory = memory_type.build(ckpt)
        if memory is not None:
            out[name] = memory
    return out


@dataclass(frozen=True)
class SessionConfig:
    """A session's memories and their settings: the ones it has on, by name, in registry order."""

    memories: Mapping[str, MemorySettings] = field(default_factory=dict)

    def __contains__(self, name: object) -> bool:
        return name in self.memories

    def get(self, name: str) -> MemorySettings | None:
        return self.memories.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.memories)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: settings.model_dump() for name, settings in self.memories.items()}

    @staticmethod
    def resolve(memories: Mapping[str, Memory], asked: Mapping[str, Mapping[str, Any] | None] | None = None,
                ) -> SessionConfig:
        """The settings of a session that asks for `asked` (name -> settings to change, None to turn it off; a
        memory not named keeps its default) among the checkpoint's `memories`. MemorySettingsError for a memory the
        checkpoint cannot serve that is asked for on, or a setting refused."""
        asked = dict(asked or {})
        for name, given in asked.items():
            if name not in memories and given is not None:  # off is what a memory the model lacks already is
                raise MemorySettingsError(f"this model has no session memory {name!r} (it has: "
                                          f"{', '.join(memories) or 'none'})", memory=name, code="unsupported")
        on: dict[str, MemorySettings] = {}
        for name, memory in memories.items():
            if name in asked:
                given = asked[name]
                if given is not None:
                    on[name] = memory.settings(given)
            elif (default := memory.defaults()) is not None:
                on[name] = default
        for name in list(on):  # a memory that replaces others drops them
            for other in memories[name].replaces if name in on else ():
                on.pop(other, None)
        return SessionConfig(on)


# -- the search path: the network with the rows' sessions' distribution memories mixed in -------------------------


def split_branches(state: State, names: Sequence[str]) -> tuple[State, dict[str, State]]:
    """A search row's state -> (the network's, with any roots; each memory's branch state, by name)."""
    net = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.tensors.items():
        head, sep, rest = key.partition(MEMORY_PREFIX_SEP)
        if sep and head in names:
            parts.setdefault(head, {})[rest] = value
        else:
            net[key] = value
    return State(net, state.roots), {name: State(t) for name, t in parts.items()}


def merge_branches(net: State, branches: Mapping[str, State | None]) -> State:
    """The network's state with the memories' branch states (their tensors prefixed "<name>.")."""
    extra = {f"{name}{MEMORY_PREFIX_SEP}{k}": v for name, b in branches.items() if b is not None
             for k, v in b.tensors.items()}
    return State({**net.tensors, **extra}, net.roots) if extra else net


class MemoryMixed(LanguageModel):
    """The network with each row's session's distribution memories mixed in, for sampling and the keyboard's word
    search. The memories' views come in the adapter (`Adapter.memories`: name -> (one view per session, the session
    of each row or -1)); they are read, never changed. A row's state carries its memories' branch states beside the
    network's. A row without a memory gets the distribution it had unchanged."""

    def __init__(self, base: LanguageModel, memories: Sequence[Memory]) -> None:
        super().__init__()
        self.base = base
        self.memories = [m for m in memories if m.kind == "distribution"]
        self._names = [m.name for m in self.memories]
        self.config = base.config
        self.frozen = base.frozen
        self.grouped_adapters = base.grouped_adapters
        # a network without a branch form (the mLSTM): branch and settle hand a state back as it is, unsplit
        self._one_form = type(base).branch is LanguageModel.branch and type(base).settle is LanguageModel.settle
        self.train(base.training)  # the network's mode: a toggle of the wrapper (`generate`) gives it back as it was

    def init_state(self, batch: int) -> State:
        device = next(self.base.parameters()).device
        return merge_branches(self.base.init_state(batch),
                              {m.name: m.branch_state(None, batch, device) for m in self.memories})

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        net_state, branches = split_branches(state, self._names)
        inner = Adapter(adapter.mats, counts=adapter.counts) if adapter is not None and adapter.mats else None
        out = self.base(tokens, net_state, inner)
        given = adapter.memories if adapter is not None else {}
        if not any(m.name in given for m in self.memories):
            return Output(logits=out.logits, state=merge_branches(out.state, branches), aux=out.aux,
                          hidden=out.hidden)
        log_dist = self.base.log_probs(out).float()  # (B, T, V)
        B = tokens.shape[0]
        for memory in self.memories:
            if memory.name not in given:
                continue
            views, index = given[memory.name]
            # as given (on the host from `Adapter.with_sessions`): a memory that reads it on the host (which views to
            # mix) does not wait for the device, one that needs it there moves it
            index = torch.zeros(B, dtype=torch.long) if index is None else index
            if memory.needs_hidden and out.hidden is None:
                raise ValueError(f"the {memory.name} memory needs the model's hidden states (Output.hidden)")
            log_dist, branch = memory.read(log_dist, tokens, out.hidden, branches.get(memory.name), views, index)
            if branch is not None:
                branches[memory.name] = branch
        return Output(logits=log_dist, state=merge_branches(out.state, branches), aux=out.aux, hidden=out.hidden)

    def branch(self, state: State) -> State:
        """The network's branch form (its part of the state; each row's memory branch states stay its own)."""
        if ROOT in state.tensors or self._one_form:
            return state
        net, branches = split_branches(state, self._names)
        return merge_branches(self.base.branch(net), branches)

    def settle(self, state: State) -> State:
        if self._one_form:
            return state
        net, branches = split_branches(state, self._names)
        return merge_branches(self.base.settle(net), branches)

    def adaptation_sites(self) -> list[Site]:
        return self.base.adaptation_sites()

    def log_probs(self, output: Output) -> torch.Tensor:
        return torch.log_softmax(output.logits.float(), -1)  # the network's logits, or the mixture's log p

