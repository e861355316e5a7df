"""The transformers' branch form (models/_branches.py, `LanguageModel.branch`): rows stepped over a shared root give
the usual steps' log-probabilities and, settled, their states; the root is never copied; window slides in the
middle of a branch take the usual path, segment closings a new root (or the usual path); searches and generation
give the same results.

Both forms run in the same test on the same random model: a property, not one machine's numbers.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kernels import _dispatch as kernel_dispatch
from models._branches import RootStack, append_tail, dense, grow, no_keys, row_attention, tail_padding, tree_attention
from models.adaptation import CacheConfig, CacheMemory
from models.base import ROOT, Adapter, LanguageModel, State
from models.char_transformer import CharTransformer, CharTransformerConfig
from models.compressive import CompressiveConfig, CompressiveTransformer
from models.copymodel import CopyConfig, CopyMemory, CopyModel, branch_view, frozen_stats
from models.memory import MemoryMixed, merge_branches
from models.sampling import SamplingParams, Stepper
from models.suggest import WordSearch, advance, complete_word, split_word, step
from tests._families import assert_batched_steppers_equal_each_alone, assert_states_close

TOL = {"rtol": 1e-4, "atol": 1e-5}  # float rounding of a different summation order, on any CPU


pytestmark = pytest.mark.usefixtures("one_thread")


def _compressive(seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    # S = 6: a branch of a few bytes closes a segment (and evicts, compresses) in the middle
    cfg = CompressiveConfig(d_model=16, n_layer=2, n_head=2, d_ff=32, segment=6, mem_len=9, cmem_len=4, rate=3)
    model = CompressiveTransformer(cfg)
    with torch.no_grad():  # u, v away from zero: the relative terms (c), (d) count
        for b in model.layers:
            b.u.normal_()
            b.v.normal_()
    return model.freeze()


def _char(seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    # C = 10: a branch of a few bytes fills the window and slides in the middle
    return CharTransformer(CharTransformerConfig(d_model=16, n_layer=2, n_head=2, d_ff=32, context=10,
                                                 adapt_layer=0)).freeze()


MODELS = {"compressive": _compressive, "char-transformer": _char}


def _after(model: LanguageModel, data: bytes, device: str = "cpu") -> State:
    with torch.no_grad():
        return model(torch.tensor([list(data)], device=device), model.init_state(1)).state


def _step(model: LanguageModel, state: State, tokens: list[int], adapter: Adapter | None = None,
          device: str = "cpu") -> tuple[State, torch.Tensor]:
    with torch.no_grad():
        out = model(torch.tensor(tokens, device=device).view(-1, 1), state, adapter)
    return out.state, model.log_probs(out)[:, -1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("prefix", [0, 4, 17])
def test_a_tree_of_branches_equals_the_usual_steps(name: str, prefix: int, device: str) -> None:
    """Branches of different depths, regrouped between steps as a search regroups them (rows taken, parts stacked),
    each under its own adapter, stepped over 7 rounds (past segment closings and window slides). On CUDA with the
    reference kernels (a GPU served with ADAPTLM_KERNELS=reference: the Triton kernels keep the usual path)."""
    model = MODELS[name]().to(device)
    with kernel_dispatch.forced("reference"):
        root = _after(model, bytes(range(40, 40 + prefix)) if prefix else b"\n", device)
        branch = model.branch(root)
        assert ROOT in branch.tensors
        _tree_rounds(model, root, branch, torch.Generator().manual_seed(prefix), device)


def _tree_rounds(model: LanguageModel, usual: State, branch: State, gen: torch.Generator, device: str) -> None:
    assert model.branch(branch) is branch
    rows = 1
    for _ in range(7):
        tokens = torch.randint(32, 127, (rows,), generator=gen).tolist()
        k = model.adaptation_sites()[0].adapter_size()
        adapter = Adapter({"resid": 0.1 * torch.randn(rows, k, k, generator=gen).to(device)})
        usual, lp_usual = _step(model, usual, tokens, adapter, device)
        branch, lp_branch = _step(model, branch, tokens, adapter, device)
        torch.testing.assert_close(lp_branch, lp_usual, **TOL)
        assert_states_close(model.settle(branch), usual, **TOL)
        # regroup: some rows twice, some dropped, and a second part stacked (different depths: an older part)
        index = torch.randint(0, rows, (min(rows + 2, 6),), generator=gen).to(device)
        usual = State.stack([usual.take(index), usual.select(slice(0, 1))])
        branch = State.stack([branch.take(index), branch.select(slice(0, 1))])
        rows = usual.batch


@pytest.mark.parametrize("name", list(MODELS))
def test_rows_of_several_roots_step_together_as_the_usual_steps(name: str) -> None:
    """The rows of five searches (several typists: roots after 1, 4, 5, 9 and 17 bytes, so at different fills, some
    at a segment end or a full window on the first step) stacked into one step as the server's rounds stack them,
    each row under its own adapter, over 8 rounds regrouped within each search: the log-probs and settled states
    equal the usual steps' of the same rows, and the step keeps one root per search until its rows cross."""
    model = MODELS[name]()
    gen = torch.Generator().manual_seed(5)
    usual = [_after(model, bytes(range(40, 40 + m))) for m in (1, 4, 5, 9, 17)]
    branch = [model.branch(s) for s in usual]
    k = model.adaptation_sites()[0].adapter_size()
    for _ in range(8):
        sizes = [s.batch for s in usual]
        tokens = torch.randint(32, 127, (sum(sizes),), generator=gen).tolist()
        adapter = Adapter({"resid": 0.1 * torch.randn(sum(sizes), k, k, generator=gen)})
        stacked = State.stack(branch)
        assert len(stacked.roots) == sum(len(b.roots) for b in branch)  # each search's roots, none copied
        after_u, lp_u = _step(model, State.stack(usual), tokens, adapter)
        after_b, lp_b = _step(model, stacked, tokens, adapter)
        torch.testing.assert_close(lp_b, lp_u, **TOL)
        assert_states_close(model.settle(after_b), after_u, **TOL)
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        usual, branch = [], []
        for start, size in zip(starts, sizes, strict=True):
            index = torch.randint(start, start + size, (min(size + 1, 4),), generator=gen)
            usual.append(after_u.take(index))
            branch.append(after_b.take(index))


@pytest.mark.parametrize("name", list(MODELS))
def test_only_the_rows_that_cross_take_the_usual_path(name: str) -> None:
    """Rows of a root whose next byte closes a segment (slides the window) and rows of a root far from it, in one
    step: the latter still read their root in place (the same root, a tail of one byte), the former get a root of
    their own: the window slid (an empty tail; the usual path), the root with the segment closed (the byte kept in
    the tail: closed in the form, tests/models/test_compressive.py); the log-probs are the usual steps'."""
    model = MODELS[name]()
    S = 6 if name == "compressive" else 10  # the tiny models' segment, window
    far, near = _after(model, b"\nab"), _after(model, bytes(range(40, 40 + (2 * S - 1 if S == 6 else S))))
    branched = model.branch(far)
    state = State.stack([branched.take(torch.zeros(2, dtype=torch.long)), model.branch(near), branched])
    # rows: far, far, near, far
    roots = state.roots
    after, lp = _step(model, state, [97, 98, 99, 100])
    want = _step(model, State.stack([far, far, near, far]), [97, 98, 99, 100])[1]
    torch.testing.assert_close(lp, want, **TOL)
    ids = after.tensors["memo.root"].tolist()
    assert after.roots[ids[0]] is roots[0] and ids[0] == ids[1] == ids[3]
    assert after.roots[ids[2]] is not roots[1] and len(after.roots) == 2
    assert after.tensors["memo.tail_n"].tolist() == [1, 1, 1 if name == "compressive" else 0, 1]


@pytest.mark.parametrize("name", list(MODELS))
def test_the_root_is_shared_not_copied(name: str) -> None:
    model = MODELS[name]()
    root = model.branch(_after(model, b"\nIt is a tru"))  # 12 bytes: two more close no segment, fill no window
    big = "mem0" if "mem0" in root.roots[0].tensors else "k0"
    ptr = root.roots[0].tensors[big].data_ptr()
    rows = root.take(torch.zeros(5, dtype=torch.long))
    after, _ = _step(model, rows, [ord(c) for c in "uaeio"])
    regrouped = State.stack([after.take(torch.tensor([0, 0, 3])), after.select(slice(1, 2))])
    after, _ = _step(model, regrouped, [1, 2, 3, 4])
    assert after.batch == 4 and len(after.roots) == 1 and after.roots[0].tensors[big].data_ptr() == ptr
    assert big not in after.tensors

@pytest.mark.parametrize("name", list(MODELS))
def test_generation_in_the_branch_form_equals_one_forward(name: str) -> None:
    """Byte by byte from a branch-form state (crossing segment ends and window slides) equals one long forward."""
    model = MODELS[name]()
    data = bytes(range(50, 90))
    with torch.no_grad():
        whole = model.log_probs(model(torch.tensor([list(data)]), model.init_state(1)))[0]
        state = model.branch(model.init_state(1))
        for i, b in enumerate(data):
            out = model(torch.tensor([[b]]), state)
            state = out.state
            torch.testing.assert_close(model.log_probs(out)[0, -1], whole[i], **TOL)
    assert_states_close(model.settle(state), _after(model, data), **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_generations_batched_and_a_fork_equal_each_alone(name: str) -> None:
    """Three sequences (one a fork: its root shared with the sequence it forked from) fed in one step a byte at a
    time (`Stepper.feed_many`, past segment ends and window slides) give each one's logits alone."""
    model = MODELS[name]()

    def steppers() -> list[Stepper]:
        out = []
        for prompt in (b"one", b"the second"):
            s = Stepper(model, SamplingParams(max_tokens=50, seed=1))
            s.prefill(prompt)
            out.append(s)
        return [*out, out[1].fork(SamplingParams(max_tokens=50, seed=2))]

    assert_batched_steppers_equal_each_alone(steppers, 14, **TOL)


def _roomy(name: str) -> LanguageModel:
    """The tiny model with a window (segments) long enough that rows step over the same roots for a few bytes."""
    torch.manual_seed(0)
    if name == "compressive":
        cfg = CompressiveConfig(d_model=16, n_layer=2, n_head=2, d_ff=32, segment=12, mem_len=12, cmem_len=4, rate=3)
        return CompressiveTransformer(cfg).freeze()
    return CharTransformer(CharTransformerConfig(d_model=16, n_layer=2, n_head=2, d_ff=32, context=24)).freeze()


@pytest.mark.parametrize("roomy", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_generations_of_roots_of_their_own_fed_together_equal_each_alone(name: str, roomy: bool) -> None:
    """Four sequences from prompts of different lengths (roots at different fills), fed in one step a byte at a time
    past segment ends and window slides: every row has a root of its own, so from the second step over the same
    roots the step reads their keys stacked in one batch (`RootStack`, made again as rows cross), and gives each
    one's logits alone."""
    model = _roomy(name) if roomy else MODELS[name]()

    def steppers() -> list[Stepper]:
        out = []
        for prompt in (b"one", b"the second", b"", b"a fourth, longer"):
            s = Stepper(model, SamplingParams(max_tokens=50, seed=len(prompt)))
            s.prefill(prompt)
            out.append(s)
        return out

    assert_batched_steppers_equal_each_alone(steppers, 16, **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_branch_form_steps_under_bf16_autocast(name: str) -> None:
    """Under CPU bf16 autocast (a caller's `torch.autocast`), a row of its own (one generation), rows of roots of their
    own stacked (generations fed together) and rows sharing a root (a search) step as the usual form does, within
    bf16's rounding, the compressive rows past a close in the form that compresses (at 18): one row of its own failed
    in the char-transformer (an in-place product of bf16 and float32)."""
    model = MODELS[name]()
    states = [_after(model, bytes(range(40, 40 + m))) for m in (14, 5)]
    cases = {"one": [states[0]], "own": states, "shared": [states[0], states[0]]}
    for case, rows in cases.items():
        usual = State.stack(rows)
        branch = model.branch(states[0]).take(torch.zeros(2, dtype=torch.long)) if case == "shared" else \
            State.stack([model.branch(s) for s in rows])
        for i in range(4):  # past the first step over the same roots (`RootStack`)
            tokens = [97 + i + j for j in range(len(rows))]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                usual, lp_usual = _step(model, usual, tokens)
                branch, lp_branch = _step(model, branch, tokens)
            torch.testing.assert_close(lp_branch.float(), lp_usual.float(), rtol=0, atol=0.05, msg=case)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_step_keeps_the_residual_stream_in_its_dtype_under_autocast(name: str) -> None:
    """A block's one-position outputs (`step_outputs`, the decode step's) add to the residual stream as `outputs`
    does: under a bf16 autocast the stream stays float32 (summed into the bf16 product, it was rounded to bf16)."""
    model = MODELS[name]()
    blocks = model.layers if name == "compressive" else model.blocks
    D = model.config.d_model
    x, att = torch.randn(3, D, generator=torch.Generator().manual_seed(0)), torch.randn(3, D)
    for block in blocks:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            step, usual = block.step_outputs(x, att), block.outputs(x[:, None], att[:, None])[:, 0]
        assert step.dtype == usual.dtype == torch.float32
        torch.testing.assert_close(step, usual, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("context", ["It is a tr", "and th", "she ", "a single ma"])
def test_a_search_in_the_branch_form_finds_what_the_usual_one_finds(name: str, context: str) -> None:
    model = MODELS[name](1)
    cursor = advance(model, model.init_state(1), b"\n" + context.encode())
    prefix = split_word(context)[1]
    usual = WordSearch(cursor, prefix, k=5, max_chars=4, min_prob=1e-4, batch=8)
    while (request := usual.request()) is not None:
        usual.feed(*step(model, *request, None))
    found = complete_word(model, cursor, prefix, k=5, max_chars=4, min_prob=1e-4, batch=8)
    want = usual.result()
    assert [c.text for c in found.completions] == [c.text for c in want.completions]
    assert found.expansions == want.expansions
    for a, b in zip(found.completions, want.completions, strict=True):
        assert a.prob == pytest.approx(b.prob, rel=1e-4)
    branched = WordSearch(cursor, prefix, k=5, max_chars=4, min_prob=1e-4, batch=8, model=model)
    while (request := branched.request()) is not None:
        branched.feed(*step(model, *request, None))
    assert list(branched.next_cursors) == list(usual.next_cursors)
    for key, c in usual.next_cursors.items():  # handed out settled: the usual form
        d = branched.next_cursors[key]
        assert_states_close(d.state, c.state, **TOL)
        torch.testing.assert_close(d.logprobs, c.logprobs, **TOL)


def test_state_take_and_stack_keep_one_shared_row_a_view() -> None:
    row = torch.randn(1, 3, 2)
    s = State({"m": row, "n": torch.tensor([7])})
    t = s.take(torch.tensor([0, 0, 0]))
    assert t.tensors["m"].stride(0) == 0 and torch.equal(t.tensors["m"], row.expand(3, 3, 2))
    u = State.stack([t, s, t.select(slice(1, 2))])
    assert u.tensors["m"].stride(0) == 0 and u.batch == 5 and torch.equal(u.tensors["n"], torch.tensor([7] * 5))
    other = State({"m": torch.randn(1, 3, 2), "n": torch.tensor([8])})
    mixed = State.stack([t, other])  # two different rows: a copy, as before
    assert mixed.tensors["m"].stride(0) != 0 and torch.equal(mixed.tensors["m"][3], other.tensors["m"][0])


def test_state_roots_are_kept_once_and_renumbered() -> None:
    """Rows of states in a branch form stack with their roots in one tuple, each root once (by identity), the rows'
    root ids renumbered; selecting rows keeps only the roots they name; no root is copied."""
    r0, r1, r2 = (State({"m": torch.full((1, 3), float(i))}) for i in range(3))
    a = State({ROOT: torch.tensor([1, 0, 1])}, (r0, r1))
    b = State({ROOT: torch.tensor([0, 1])}, (r2, r0))
    both = State.stack([a, b])
    assert both.roots == (r0, r1, r2) and all(x is y for x, y in zip(both.roots, (r0, r1, r2), strict=True))
    assert both.tensors[ROOT].tolist() == [1, 0, 1, 2, 0]
    few = both.take(torch.tensor([3, 1]))
    assert few.roots[0] is r0 and few.roots[1] is r2 and few.tensors[ROOT].tolist() == [1, 0]
    assert both.select(slice(0, 1)).roots[0] is r1
    with pytest.raises(ValueError, match="settle"):
        both.persistent()
    with pytest.raises(ValueError, match="usual form"):
        State.stack([a, State({ROOT: torch.tensor([0])})])


def test_append_tail_drops_the_padding() -> None:
    mem = torch.arange(8.0).view(2, 4, 1)  # rows [0..3], [4..7]
    tail = torch.tensor([[0.0, 0.0, 10.0], [0.0, 20.0, 21.0]]).view(2, 3, 1)  # valid: the last 1 and the last 2
    out = append_tail(mem, tail, torch.tensor([1, 2]))
    assert out.view(2, 4).tolist() == [[1.0, 2.0, 3.0, 10.0], [6.0, 7.0, 20.0, 21.0]]
    same = append_tail(mem, tail, torch.tensor([2, 2]))  # every row as many: sliced, not gathered
    assert same.view(2, 4).tolist() == [[2.0, 3.0, 0.0, 10.0], [6.0, 7.0, 20.0, 21.0]]
    one = append_tail(mem[:1].expand(3, 4, 1), tail[1:].expand(3, 3, 1), torch.tensor([3, 3, 3]))  # one row's views
    assert one.view(3, 4).tolist() == [[3.0, 0.0, 20.0, 21.0]] * 3


def test_tree_attention_equals_attention_over_each_rows_keys() -> None:
    """Rows on two roots of different lengths (one in two parts), their rows interleaved, tails of different
    lengths, against a softmax over each row's keys alone."""
    gen = torch.Generator().manual_seed(0)
    B, H, Dh, t = 4, 2, 4, 3

    def r(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen)
    lengths = [5, 2]  # each root's keys
    rk, rv = [r(H, L, Dh) for L in lengths], [r(H, L, Dh) for L in lengths]
    q, tk, tv, bias = r(B, H, Dh), r(B, H, t, Dh), r(B, H, t, Dh), r(B, H, max(lengths) + t)
    n = torch.tensor([1, 3, 2, 3])
    rows = [torch.tensor([0, 2]), torch.tensor([1, 3])]
    pad = tail_padding(n, t)
    got = tree_attention(q, [(rows[0], [(rk[0][:, :2], rv[0][:, :2]), (rk[0][:, 2:], rv[0][:, 2:])]),
                             (rows[1], [(rk[1], rv[1])])], tk, tv, pad, 0.5, bias)
    # the same rows as runs of consecutive rows (slices), as `groups` gives them
    perm = torch.tensor([0, 2, 1, 3])
    runs = tree_attention(q[perm], [(slice(0, 2), [(rk[0][:, :2], rv[0][:, :2]), (rk[0][:, 2:], rv[0][:, 2:])]),
                                    (slice(2, 4), [(rk[1], rv[1])])], tk[perm], tv[perm],
                          tail_padding(n[perm], t), 0.5, bias[perm])
    torch.testing.assert_close(runs, got[perm])
    for b in range(B):
        g = 0 if b in rows[0].tolist() else 1
        L, Lmax = lengths[g], max(lengths)
        tail = list(range(t - int(n[b]), t))
        k = torch.cat([rk[g], tk[b][:, tail]], 1)  # (H, Lk, Dh)
        v = torch.cat([rv[g], tv[b][:, tail]], 1)
        places = list(range(Lmax - L, Lmax)) + [Lmax + j for j in tail]  # the keys' places in the bias
        p = torch.softmax(0.5 * ((q[b].unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) + bias[b][:, places]), -1)
        torch.testing.assert_close(got[b], (p.unsqueeze(1) @ v).squeeze(1))
    one = tree_attention(q, [(slice(None), [(rk[0], rv[0])])], tk, tv, pad, 0.5)  # one root: every row in one slice
    for b in range(B):
        keep = list(range(t - int(n[b]), t))
        k, v = torch.cat([rk[0], tk[b][:, keep]], 1), torch.cat([rv[0], tv[b][:, keep]], 1)
        p = torch.softmax(0.5 * (q[b].unsqueeze(1) @ k.transpose(1, 2)).squeeze(1), -1)
        torch.testing.assert_close(one[b], (p.unsqueeze(1) @ v).squeeze(1))


def test_row_attention_equals_tree_attention_of_one_row_per_root() -> None:
    """Rows of keys of their own (in two parts, the roots right-aligned in L places, padding first), tails with
    padding, a bias: what `tree_attention` gives each row with its root as a group of its own."""
    gen = torch.Generator().manual_seed(1)
    B, H, Dh, t, L = 3, 2, 4, 4, 6
    sizes = [6, 4, 5]  # each row's root keys: the first in two parts (2 + 4), padding before the others

    def r(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen)
    q, tk, tv, bias = r(B, H, Dh), r(B, H, t, Dh), r(B, H, t, Dh), r(B, H, L + t)
    keys = [(r(H, Lb, Dh), r(H, Lb, Dh)) for Lb in sizes]
    n = torch.tensor([4, 2, 3])
    groups = [(slice(b, b + 1), [(k[:, :2], v[:, :2]), (k[:, 2:], v[:, 2:])] if b == 0 else [(k, v)])
              for b, (k, v) in enumerate(keys)]
    want = tree_attention(q, groups, tk, tv, tail_padding(n, t), 0.5, bias)
    stacked = torch.zeros(2, B, H, L, Dh)  # the roots right-aligned in L places, as `RootStack` lays them out
    for b, (k, v) in enumerate(keys):
        stacked[0, b, :, L - sizes[b] :], stacked[1, b, :, L - sizes[b] :] = k, v
    k2, v2 = stacked.view(2, B * H, L, Dh)
    parts = [(k2[:, :3], v2[:, :3]), (k2[:, 3:], v2[:, 3:])]  # any cut into parts: the same keys in key order
    root_pad = (torch.arange(L).view(1, L) < L - torch.tensor(sizes).view(B, 1)).view(B, 1, 1, L)
    got = row_attention(q.reshape(B * H, 1, Dh), parts, tk.reshape(B * H, t, Dh), tv.reshape(B * H, t, Dh),
                        no_keys(root_pad, tail_padding(n, t), B, L, t), 0.5, bias.reshape(B * H, 1, L + t))
    torch.testing.assert_close(got.view(B, H, Dh), want)
    assert no_keys(None, None, B, L, t) is None


def test_root_stack_is_made_at_the_second_step_over_the_same_roots_and_keeps_none_alive() -> None:
    """Roots stepped once (a search's first round) are not stacked; stepped again, their keys and values are stacked
    right-aligned, padding first, and the stack is kept while the same roots come, and when other roots are asked for
    once in between; other roots asked for twice replace it; the stack keeps no root alive."""
    import gc
    import weakref

    H, Dh = 2, 3
    roots = [State({"x": torch.randn(1, L, H * Dh)}) for L in (4, 2)]

    def views(root: State) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        kv = root.tensors["x"][0].view(-1, H, Dh).transpose(0, 1)  # (H, L, Dh)
        return [[(kv[:, :1], 2 * kv[:, :1]), (kv[:, 1:], 2 * kv[:, 1:])]]  # one layer, two parts
    stack = RootStack()
    assert stack.get(tuple(roots), views) is None  # the first step over these roots
    made = stack.get(tuple(roots), views)
    assert made is not None and stack.get(tuple(roots), views) is made
    L, layers, no_key = made
    k, v = layers[0][0]
    assert L == 4 and k.shape == (2 * H, 4, Dh) and no_key is not None
    assert no_key.flatten().tolist() == [False] * 4 + [True, True, False, False]
    for b, root in enumerate(roots):
        want = root.tensors["x"][0].view(-1, H, Dh).transpose(0, 1)  # (H, L_b, Dh)
        torch.testing.assert_close(k.view(2, H, 4, Dh)[b, :, 4 - want.shape[1] :], want)
        torch.testing.assert_close(v.view(2, H, 4, Dh)[b, :, 4 - want.shape[1] :], 2 * want)
    other = State({"x": torch.randn(1, 3, H * Dh)})
    assert stack.get((roots[1], roots[0]), views) is None  # other roots once (a search's first round) ...
    assert stack.get(tuple(roots), views) is made  # ... leave the stack made as it was
    assert stack.get((roots[0], other), views) is None  # a row's root changed: again from the second step
    again = stack.get((roots[0], other), views)
    assert again is not None and again is not made and stack.get(tuple(roots), views) is None
    gone = weakref.ref(other)
    del other
    gc.collect()
    assert gone() is None  # the stack kept no root alive
    remade = stack.get(tuple(roots), views)  # asked for the second time in a row: stacked again
    assert remade is not None and remade is not made and stack.get(tuple(roots), views) is remade


def test_dense_is_the_layer_and_follows_its_weights() -> None:
    """`dense` gives the layer's output (several layers side by side), and after the weights or biases change in place
    or are replaced, the new ones' (its transposed copy is made again)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 5), torch.nn.Linear(6, 3)
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(dense(a, x), a(x))
        torch.testing.assert_close(dense((a, b), x), torch.cat([a(x), b(x)], 1))
        a.weight.mul_(2.0)  # in place: its version
        b.weight.add_(1.0)
        torch.testing.assert_close(dense(a, x), a(x))
        torch.testing.assert_close(dense((a, b), x), torch.cat([a(x), b(x)], 1))
        a.weight = torch.nn.Parameter(torch.randn(5, 6))  # replaced
        torch.testing.assert_close(dense(a, x), a(x))
        a.bias.add_(1.0)  # a bias alone (its weight unchanged)
        b.bias.sub_(1.0)
        torch.testing.assert_close(dense(a, x), a(x))
        torch.testing.assert_close(dense((a, b), x), torch.cat([a(x), b(x)], 1))


def test_dense_keeps_no_layer_alive() -> None:
    """`dense`'s transposed copies go with their layers: a network stepped in the branch form once and dropped (a full
    dynamic evaluation's private copy, a keyboard simulation's) is freed, its copies with it; they were kept, with
    the layers and their weights, for the life of the process."""
    import gc
    import weakref

    layer, pair = torch.nn.Linear(6, 5), (torch.nn.Linear(6, 3), torch.nn.Linear(6, 2))
    model = _char()
    with torch.no_grad():
        dense(layer, torch.randn(2, 6))
        dense(pair, torch.randn(2, 6))
        _step(model, model.branch(_after(model, b"\nab")), [99])
    gone = [weakref.ref(m) for m in (layer, *pair, model, model.head)]
    del layer, pair, model
    gc.collect()
    assert [ref() for ref in gone] == [None] * len(gone)


def test_tail_padding_is_none_where_every_tail_is_whole() -> None:
    assert tail_padding(torch.tensor([3, 3]), 3) is None and tail_padding(torch.tensor([0]), 0) is None
    assert tail_padding(torch.tensor([1, 3]), 3).tolist() == [[[True, True, False]], [[False, False, False]]]


def test_grow_writes_in_place_only_past_the_newest_view() -> None:
    """A tail grown twice from the same state (a row stepped again, a fork) or taken from (rows of a batch) gets a copy;
    the newest view of a buffer grows in place; what an older tail shows never changes; the values are the
    concatenation's."""
    a = torch.arange(6.0).view(2, 3, 1)
    b = grow(a, torch.full((2, 1), 10.0))  # not a buffer's view: a new buffer
    assert torch.equal(b, torch.cat([a, torch.full((2, 1, 1), 10.0)], 1))
    c = grow(b, torch.full((2, 1), 11.0))  # b is its buffer's newest view: in place, the same buffer
    assert c.data_ptr() == b.data_ptr() and torch.equal(c[:, :4], b) and c[:, 4].flatten().tolist() == [11.0, 11.0]
    again = grow(b, torch.full((2, 1), 12.0))  # b stepped again: a copy, c unchanged
    assert again.data_ptr() != c.data_ptr() and c[:, 4].flatten().tolist() == [11.0, 11.0]
    assert again[:, 4].flatten().tolist() == [12.0, 12.0] and torch.equal(again[:, :4], b)
    row = grow(c[1:], torch.full((1, 1), 13.0))  # a row of the batch: a copy
    assert row.data_ptr() != c.data_ptr() and torch.equal(row[:, :5], c[1:]) and grow(c, c[:, 0]).shape == (2, 6, 1)
    assert c.shape == (2, 5, 1) and c[:, 4].flatten().tolist() == [11.0, 11.0]
    full = b
    for i in range(80):  # past the buffer's room: a new buffer, the same values
        full = grow(full, torch.full((2, 1), float(i)))
    assert full.shape == (2, 84, 1) and full[0, 4:, 0].tolist() == [float(i) for i in range(80)]
    assert torch.equal(grow(a[:, :0], a[:, 0]), a[:, :1])  # an empty tail
    tok = grow(torch.zeros(3, 0, dtype=torch.long), torch.tensor([1, 2, 3]))  # (B, t) bytes
    assert grow(tok, torch.tensor([4, 5, 6])).tolist() == [[1, 4], [2, 5], [3, 6]]


@pytest.mark.parametrize("name", list(MODELS))
def test_the_served_wrappers_keep_the_branch_form(name: str) -> None:
    """The server runs suggestions and generation on the network wrapped with the sessions' copy models and neural
    caches (`SessionModel.search_model`: MemoryMixed(network, [copy, cache])): the wrapper branches and settles as the
    network does (an identity there would keep the server from the branch form), and steps through it, the
    copy model mixed in, equal the usual form's."""
    model = MODELS[name]()
    copy = CopyModel(CopyConfig())
    learned = copy.init_state(1)
    text = b"\nIt is a truth universally acknowledged, that a truth is a truth"
    with torch.no_grad():
        _, learned = copy.mix(torch.full((1, len(text), 256), -math.log(256)), torch.tensor([list(text)]), learned)
    served = MemoryMixed(model, [CopyMemory(copy), CacheMemory(CacheConfig())])
    usual = merge_branches(_after(model, text), {"copy": branch_view(learned)})
    branch = served.branch(usual)
    assert ROOT in branch.tensors and branch.roots and served.branch(branch) is branch
    assert_states_close(served.settle(branch), usual, **TOL)
    rows = torch.zeros(3, dtype=torch.long)
    usual, branch = usual.take(rows), branch.take(rows)
    adapter = Adapter({}, {"copy": ([frozen_stats(learned)], None)})
    for tokens in ([32, 116, 97], [116, 114, 115], [117, 117, 32], [116, 32, 104], [104, 97, 116]):
        with torch.no_grad():
            u, b = served(torch.tensor(tokens).view(-1, 1), usual, adapter), served(
                torch.tensor(tokens).view(-1, 1), branch, adapter)
        torch.testing.assert_close(served.log_probs(b)[:, -1], served.log_probs(u)[:, -1], **TOL)
        usual, branch = u.state, b.state
        assert ROOT in branch.tensors
        assert_states_close(served.settle(branch), usual, **TOL)
