"""The frozen mLSTM's inference step in static shapes, captured once per shape as a CUDA graph and replayed.

A step of a few rows is launch-bound on a GPU: each time step of `MLSTM._forward` is about ten kernel launches of
microseconds of work each, plus Python. `StepRunner` takes every no-gradient call of a frozen `MLSTM` (scoring,
peeks, observes' static shadows, the keyboard search's steps and feeds, generation) and runs it in static shapes:

- rows padded to a power of two (`row_bucket`), up to `max_rows` (4,096: a search round of thousands of
  typists; more: the model's own path);
- time cut into chunks of powers of two (`chunks`: 20 steps = 16 + 4), at most `max_chunk` steps each, run one
  after the other with the state carried in the shape's buffers. Chunking, unlike padding the time axis, runs no
  step that is not real, so the recurrence needs no mask and each row's state is exact;
- the adapter in one of three forms: none, one matrix per row (B, k, k), or one per session with each row's
  session index (the search's `Adapter.counts`, turned into an index (B,) so that the graph does not depend on how
  many rows each session has).

On a CUDA device each (row bucket, chunk, adapter form, k, sessions bucket, low precision) is captured once, after
warm-up runs on a side stream (the recipe of PyTorch's CUDA graphs notes), and replayed: the inputs are copied into
the shape's static buffers, the graph replayed, the outputs copied out. On a CPU the same padded, chunked path runs
eagerly (`graphs=False`): the padding and unpadding are the same code, which the CPU tests check against the
unbucketed step. Rows are independent in every operation of the step (embedding look-ups, row-wise matmuls,
elementwise gates, per-row adapter products), so padded rows (zero tokens, zero states, the first session's or a
zero adapter) never touch the real rows' numbers; their outputs are dropped.

Not covered (the model's own path runs them): calls with gradients (the sparse adaptation step of adapting rows:
forward, hand-written backward and update rule), an unfrozen model, states in another form than (h, c), more rows
than `max_rows`, per-row adapters of more than 1 GB, and on a GPU without Triton a session-indexed adapter too
large to gather (> 256 MB).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from kernels._dispatch import kernel_implementation, triton_available
from kernels.adapter import apply_adapter_ref, batched_adapter, batched_adapter_ref
from models.base import Adapter, Output, State
from models.device import SWITCHES, switched_on

if TYPE_CHECKING:
    from models.mlstm import MLSTM

__all__ = ["GRAPH_MODES", "StepRunner", "chunks", "install_step_runner", "row_bucket", "wants_runner"]

log = logging.getLogger(__name__)

GRAPH_MODES = SWITCHES
Form = Literal["none", "rows", "groups"]
_GATHER_BYTES = 1 << 28  # a session-indexed adapter is gathered per row (m[index]) up to this size
# the largest per-row adapter buffer a shape keeps (R, k, k): 1 GB holds 256 rows (a bucket) at k = 768; more per-row
# adapters (a round of many new typists' feeds) take the model's own path, which stacks the same matrices anyway
_ROWS_BYTES = 1 << 30


def row_bucket(rows: int) -> int:
    """The rows a batch of `rows` is padded to: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def chunks(steps: int, max_chunk: int) -> list[int]:
    """`steps` as a sum of powers of two, each at most `max_chunk`, largest first (20 -> [16, 4])."""
    out = []
    while steps > 0:
        c = min(max_chunk, 1 << (steps.bit_length() - 1))
        out.append(c)
        steps -= c
    return out


@dataclass(frozen=True)
class _Key:
    rows: int  # row bucket
    form: Form
    k: int  # adapter size (0: none)
    sessions: int  # sessions bucket of the "groups" form (0: other forms)
    lowp: torch.dtype | None


@dataclass
class _Shape:
    """The static buffers of one (row bucket, adapter form) and the graphs of its chunks."""

    tokens: torch.Tensor  # (R, max_chunk) int64; a chunk of c steps reads [:, :c]
    h: torch.Tensor  # (R, H) the state in and, after each chunk, out
    c: torch.Tensor
    mats: torch.Tensor | None  # (R, k, k) rows form, (S, k, k) groups form
    index: torch.Tensor | None  # (R,) int64: each row's session (groups form)
    weights: tuple[torch.Tensor, ...]  # what the graphs read (kept alive; a change drops the graphs)
    graphs: dict[int, tuple[Callable[[], None], torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    rows_filled: int = 0  # rows of the last call (padding beyond them is zeroed when a call has fewer)
    mats_from: tuple[torch.Tensor, int] | None = None  # the adapter tensor (and its version) the buffer holds
    index_from: tuple[int, ...] | None = None  # the counts the index buffer holds


class StepRunner:
    """Runs a frozen `MLSTM`'s no-gradient forward in bucketed static shapes (module docstring). `graphs`: capture
    and replay CUDA graphs (a CUDA model only); otherwise the padded path runs eagerly."""

    def __init__(self, model: MLSTM, *, graphs: bool, max_rows: int = 4096, max_chunk: int = 32) -> None:
        device = next(model.parameters()).device
        if graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if max_rows < 1 or max_chunk < 1 or max_chunk & (max_chunk - 1):
            raise ValueError("max_rows >= 1 and max_chunk a power of two")
        self.model, self.graphs, self.max_rows, self.max_chunk = model, graphs, max_rows, max_chunk
        self.device = device
        self._shapes: dict[_Key, _Shape] = {}
        self._pool: Any = None  # the graphs' shared memory pool (a handle from the first graph)
        self.calls = 0  # steps it ran (a test's and a metric's view)
        self.declined = 0  # calls left to the model's own path
        self._declined_why: set[str] = set()
        self.captured = 0  # graphs captured
        self._uncapturable: set[tuple[_Key, int]] = set()  # (shape, chunk) whose capture failed: the model's path

    # -- the call ------------------------------------------------------------------------------------------

    def __call__(self, tokens: torch.Tensor, state: State, adapter: Adapter | None,
                 lowp: torch.dtype | None) -> Output | None:
        """The model's output for (tokens (B, T), state, adapter), or None: not a call it runs (module docstring)."""
        B, T = tokens.shape
        form, k, mats, counts = self._form(adapter, B)
        why = ("an adapter of another form" if form is None else "more rows than max_rows" if B > self.max_rows
               else "a state of another form" if state.roots or set(state.tensors) != {"h", "c"}
               or state.tensors["h"].shape[0] != B else "another device" if tokens.device != self.device
               else "nothing to run" if B == 0 or T == 0 else None)
        R = row_bucket(B)
        S = row_bucket(len(counts)) if counts is not None else 0
        if why is None and form == "groups" and not self._groups_fit(R, k):
            why = "a session-indexed adapter too large to gather without Triton"
        if why is None and form == "rows" and R * k * k * 4 > _ROWS_BYTES:
            why = "per-row adapters of more than 1 GB"
        if why is not None:
            self._decline(why)
            return None
        assert form is not None
        key = _Key(R, form, k, S, lowp)
        parts = chunks(T, self.max_chunk)
        if any((key, c) in self._uncapturable for c in parts):
            self._decline("a shape whose capture failed")
            return None
        try:
            return self._run(key, tokens, state, mats, counts, parts)
        except _NotCapturable:
            self._decline("a shape whose capture failed")
            return None

    def _run(self, key: _Key, tokens: torch.Tensor, state: State, mats: torch.Tensor | None,
             counts: tuple[int, ...] | None, parts: list[int]) -> Output:
        B = tokens.shape[0]
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            shape = self._shape(key, key.lowp)
            self._fill(shape, B, state, mats, counts)
            logits, hidden = [], []
            t = 0
            for i, c in enumerate(parts):
                shape.tokens[:B, :c].copy_(tokens[:, t : t + c])
                run, out_logits, out_hidden = self._graph(shape, key, c)
                run()
                lg, hd = out_logits[:B], out_hidden[:B]
                # a replay's outputs are overwritten by the next replay of its graph: copied out (the last of
                # several chunks is copied by the concatenation)
                if self.graphs and (len(parts) == 1 or i < len(parts) - 1):
                    lg, hd = lg.clone(), hd.clone()
                logits.append(lg)
                hidden.append(hd)
                t += c
            self.calls += 1
            return Output(logits=torch.cat(logits, 1) if len(logits) > 1 else logits[0],
                          state=State({"h": shape.h[:B].clone(), "c": shape.c[:B].clone()}),
                          hidden=torch.cat(hidden, 1) if len(hidden) > 1 else hidden[0])

    def _decline(self, why: str) -> None:
        """Left to the model's own path; each reason logged once (on a GPU such a call runs without graphs)."""
        self.declined += 1
        if why not in self._declined_why:
            self._declined_why.add(why)
            log.log(logging.WARNING if self.graphs else logging.DEBUG,
                    "model step: a call runs without the bucketed step (%s); later ones alike are not logged", why)

    @staticmethod
    def _form(adapter: Adapter | None, B: int
              ) -> tuple[Form | None, int, torch.Tensor | None, tuple[int, ...] | None]:
        if adapter is None or not adapter.mats:
            return "none", 0, None, None
        if set(adapter.mats) != {"h"}:
            return None, 0, None, None
        m = adapter.mats["h"]
        if adapter.counts is not None:
            if sum(adapter.counts) != B or m.shape[0] != len(adapter.counts):
                return None, 0, None, None
            return "groups", m.shape[-1], m, adapter.counts
        if m.shape[0] != B:
            return None, 0, None, None
        return "rows", m.shape[-1], m, None

    def _triton_groups(self) -> bool:
        """A session-indexed adapter runs the Triton kernel (on CUDA, where the process runs Triton): no gather."""
        return self.device.type == "cuda" and triton_available() and kernel_implementation() == "triton"

    def _groups_fit(self, R: int, k: int) -> bool:
        """A session-indexed adapter's product runs without a host sync: the Triton kernel, or a gather that fits."""
        return self._triton_groups() or not self.graphs or R * k * k * 4 <= _GATHER_BYTES

    # -- buffers -------------------------------------------------------------------------------------------

    def _weights(self, lowp: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        m = self.model
        mx_table, zx_table = m._input_tables()
        assert m.head.bias is not None
        return mx_table, zx_table, m.w_mh.weight(lowp), m.w_m.weight(lowp), m.head.weight(), m.head.bias

    def _shape(self, key: _Key, lowp: torch.dtype | None) -> _Shape:
        weights = self._weights(lowp)
        shape = self._shapes.get(key)
        if shape is not None and all(a is b for a, b in zip(shape.weights, weights, strict=True)):
            return shape
        ref = weights[-1]
        H = self.model.config.hidden
        with torch.inference_mode(False):  # buffers written in place from any mode
            z = torch.zeros(key.rows, H, dtype=ref.dtype, device=self.device)
            mats = None
            if key.form != "none":
                n = key.rows if key.form == "rows" else key.sessions
                mats = torch.zeros(n, key.k, key.k, dtype=ref.dtype, device=self.device)
            shape = _Shape(tokens=torch.zeros(key.rows, self.max_chunk, dtype=torch.long, device=self.device),
                           h=z, c=z.clone(), mats=mats,
                           index=torch.zeros(key.rows, dtype=torch.long, device=self.device)
                           if key.form == "groups" else None, weights=weights)
        self._shapes[key] = shape
        return shape

    def _fill(self, shape: _Shape, B: int, state: State, mats: torch.Tensor | None,
              counts: tuple[int, ...] | None) -> None:
        """The call's state and adapter into the buffers; rows past B zeroed when the last call had more."""
        shape.h[:B].copy_(state.tensors["h"])
        shape.c[:B].copy_(state.tensors["c"])
        if shape.rows_filled > B:
            shape.h[B:].zero_()
            shape.c[B:].zero_()
            shape.tokens[B:].zero_()
            if shape.mats is not None and counts is None:
                shape.mats[B:].zero_()
        shape.rows_filled = B
        if mats is not None and shape.mats is not None:
            # the same adapter tensor, unchanged, as last time (a search's rounds): already there
            if shape.mats_from is None or shape.mats_from[0] is not mats or shape.mats_from[1] != mats._version:
                shape.mats[: mats.shape[0]].copy_(mats)
                shape.mats_from = (mats, mats._version)
        if counts is not None and shape.index is not None and shape.index_from != counts:
            index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # (B,)
            shape.index[:B].copy_(index.to(self.device, non_blocking=True))
            shape.index[B:].zero_()  # padded rows read the first session's matrix
            shape.index_from = counts

    # -- the compute and its graphs ----------------------------------------------------------------------

    def _site(self, shape: _Shape, form: Form) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if form == "none":
            return None
        mats = shape.mats
        assert mats is not None
        if form == "rows":
            return lambda h: apply_adapter_ref(h, mats)  # AdapterSteps' form without gradients
        index = shape.index
        assert index is not None
        if self._triton_groups():
            return lambda h: batched_adapter(h, mats, index, impl="triton")  # no gather, no host sync
        if index.shape[0] * mats.shape[-1] ** 2 * mats.element_size() <= _GATHER_BYTES:
            # each row its session's matrix, gathered once for the chunk's steps: the same products as
            # `apply_adapter_groups`' per-session views
            gathered = mats.index_select(0, index)  # (R, k, k)
            return lambda h: apply_adapter_ref(h, gathered)
        return lambda h: batched_adapter_ref(h, mats, index)  # the CPU's tiles (host syncs: eager only)

    def _compute(self, shape: _Shape, form: Form, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`c` steps from the buffers' state (MLSTM._forward's frozen inference path), the state written back."""
        mx_table, zx_table, w_mh, w_m, head_w, head_b = shape.weights
        site = self._site(shape, form)
        tokens = shape.tokens[:, :c]
        mx, zx = F.embedding(tokens, mx_table), F.embedding(tokens, zx_table)  # (R, c, H), (R, c, 4H)
        hs, h, cell = _steps(mx, zx, shape.h, shape.c, w_mh, w_m, site)  # (R, c, H)
        logits = F.linear(hs, head_w, head_b)  # (R, c, V)
        shape.h.copy_(h)
        shape.c.copy_(cell)
        return logits, hs

    def _graph(self, shape: _Shape, key: _Key, c: int) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
        found = shape.graphs.get(c)
        if found is not None:
            return found
        if not self.graphs:
            # eager: nothing to keep between calls; the outputs are the ones this run made
            logits, hs = self._compute(shape, key.form, c)
            return (lambda: None), logits, hs
        # warm-up and capture run the step on whatever the buffers hold: keep the call's state and restore it
        h0, c0 = shape.h.clone(), shape.c.clone()
        try:
            found = self._capture(shape, key, c)
        except Exception as e:  # an operation that cannot be captured (a host sync): this shape runs uncaptured
            log.warning("model step: the capture of %d rows x %d steps (adapter %s) failed; that shape takes the "
                        "model's own path: %s", key.rows, c, key.form, e)
            self._uncapturable.add((key, c))
            raise _NotCapturable from e
        finally:
            shape.h.copy_(h0)
            shape.c.copy_(c0)
        shape.graphs[c] = found
        return found

    def _capture(self, shape: _Shape, key: _Key, c: int) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
        """Warm-up on a side stream, then one capture (PyTorch's CUDA graphs recipe) -> (replay, logits, hidden)."""
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self._compute(shape, key.form, c)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for all the graphs: a later graph may reuse what an earlier one freed, so a replay may
        # overwrite another graph's outputs; each replay's outputs are copied out before the next replay (__call__),
        # and the state lives in the shape's buffers, outside the pool.
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hs = self._compute(shape, key.form, c)
        if self._pool is None:
            self._pool = graph.pool()
        self.captured += 1
        log.debug("captured the step of %d rows, %d steps, adapter %s (k %d)", key.rows, c, key.form, key.k)
        return graph.replay, logits, hs


class _NotCapturable(Exception):
    """A shape's capture failed: the call takes the model's own path."""


def _steps(mx: torch.Tensor, zx: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_mh: torch.Tensor,
           w_m: torch.Tensor, site: Callable[[torch.Tensor], torch.Tensor] | None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from models.mlstm import mlstm_steps  # the model's own recurrence (models.mlstm imports this module)

    return mlstm_steps(mx, zx, h, c, w_mh, w_m, site)


def wants_runner(mode: str, device: torch.device) -> bool:
    """ADAPTLM_CUDA_GRAPHS's value on `device`: auto runs the bucketed path on CUDA only (on a CPU padding only
    costs: docs/operations.md), on everywhere (eagerly on a CPU), off nowhere."""
    return switched_on(mode, device, "cuda_graphs")


def install_step_runner(model: object, mode: str) -> StepRunner | None:
    """Give `model` a step runner when `mode` wants one on its device and it is a frozen mLSTM (the one step
    covered); -> the runner, or None. CUDA graphs on a CUDA device, the eager padded path elsewhere."""
    from models.mlstm import MLSTM

    if not isinstance(model, MLSTM) or not model.frozen:
        return None
    device = next(model.parameters()).device
    if not wants_runner(mode, device):
        model.step_runner = None
        return None
    runner = StepRunner(model, graphs=device.type == "cuda")
    model.step_runner = runner
    log.info("model step: bucketed static shapes%s", ", CUDA graphs" if runner.graphs else " (eager, no graphs)")
    return runner
