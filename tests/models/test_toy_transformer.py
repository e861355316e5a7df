"""A second architecture through the whole stack: the toy transformer of tests/toy_transformer.py (a key/value
memory instead of a recurrent state, a per-position adaptation site) trained, checkpointed, scored, sampled,
adapted (sparse dynamic evaluation, batched), suggested from, and served, with nothing outside its file knowing it.

References are computed in the same run (the model's own forward, each text alone); no numbers from one machine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load as safetensors_load

from models.adaptation import DynEvalConfig, Row, TextJob, UpdateRule, batch_step, evaluate
from models.base import Adapter, Output, State
from models.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from models.keysim import ModelSuggester
from models.registry import REGISTRY, build_model, config_from_dict, register
from models.sampling import SamplingParams, generate
from models.scoring import BOS, score_bytes
from models.suggest import advance, is_word_char, suggest
from models.tokenizer import ByteTokenizer
from tests._families import (
    assert_evaluate_many_equals_each_text_alone,
    assert_states_close,
    create_session,
    observe_text,
    served,
)
from tests._training import repetitive, sparse_bits_on_repeats, train_on_test_data
from tests.toy_transformer import ToyTransformer, ToyTransformerConfig
from trainer.config import make_config
from trainer.train import evaluate_bpb

DATA = Path(__file__).resolve().parent.parent / "data"
TRAIN, VALID = DATA / "train.txt", DATA / "valid.txt"
MODEL = {"d_model": 32, "n_layer": 2, "n_head": 2, "context": 16}
TRAINING = {"batch_size": 8, "bptt": 32, "lr": 3e-3, "lr_final": 1e-3, "max_steps": 60, "valid_every": 30,
            "valid_bytes": 2000, "valid_streams": 4, "stats_batches": 2, "stats_batch_size": 4, "log_every": 10,
            "threads": 1}
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want."


def _model(seed: int = 0, **overrides: Any) -> ToyTransformer:
    torch.manual_seed(seed)
    return ToyTransformer(ToyTransformerConfig(**{**MODEL, **overrides})).eval()


def _tokens(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("toy_checkpoint")
    return out, train_on_test_data(make_config(None, {"arch": "toy-transformer", "model": MODEL, **TRAINING}), out)


@pytest.fixture(scope="module")
def ckpt(trained: tuple[Path, Any]) -> Checkpoint:
    return load_checkpoint(trained[0])


# -- the model itself -------------------------------------------------------------------------------------


def test_registered_on_import_and_config_round_trips() -> None:
    assert REGISTRY["toy-transformer"] == (ToyTransformerConfig, ToyTransformer)
    cfg = ToyTransformerConfig(**MODEL)
    assert config_from_dict(cfg.to_dict()) == cfg
    assert isinstance(build_model(cfg), ToyTransformer)


def test_causal_output_at_t_ignores_later_inputs() -> None:
    model = _model()
    x = _tokens(24)
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    a = model(x, model.init_state(1)).logits
    b = model(y, model.init_state(1)).logits
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])  # the change is seen from t = 10 on


def test_window_is_fixed_inputs_older_than_the_context_are_forgotten() -> None:
    model = _model()
    C = model.config.context
    x = _tokens(3 * C)
    y = x.clone()
    y[0, 0] = (y[0, 0] + 7) % 256
    a, b = model(x, model.init_state(1)).logits, model(y, model.init_state(1)).logits
    # two layers of a C-wide window reach back 2 (C - 1) positions; beyond that the first byte is gone
    reach = 2 * (C - 1)
    torch.testing.assert_close(a[:, reach + 1:], b[:, reach + 1:], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a[:, 1:C], b[:, 1:C])


@pytest.mark.parametrize("cuts", [[1, 2, 3], [7, 8, 30], [15, 16, 17, 40], [44]])
def test_state_carried_across_pieces_equals_one_forward(cuts: list[int]) -> None:
    model = _model()
    x = _tokens(45, batch=3)
    adapter = Adapter({"resid": 0.1 * torch.randn(3, 20, 20, generator=torch.Generator().manual_seed(1))})
    whole = model(x, model.init_state(3), adapter)
    state, logits, start = model.init_state(3), [], 0
    for cut in [*cuts, 45]:
        out = model(x[:, start:cut], state, adapter)
        state, start = out.state, cut
        logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), whole.logits, rtol=1e-5, atol=1e-5)
    assert_states_close(state, whole.state, rtol=1e-5, atol=1e-6)
    assert bool(state.tensors["mask"].all())  # 45 > context: every slot is in use


def test_fresh_state_is_empty_and_fills_from_the_newest_end() -> None:
    model = _model()
    state = model.init_state(2)
    L = model.config.context - 1
    assert state.tensors["mask"].shape == (2, L) and not bool(state.tensors["mask"].any())
    out = model(_tokens(5, batch=2), state)
    mask = out.state.tensors["mask"]
    assert mask[:, -5:].all() and not mask[:, :-5].any()
    assert out.state.row_bytes == state.row_bytes > 0


def test_stack_and_select_of_memories_of_different_lengths() -> None:
    model = _model()
    a_in, b_in = _tokens(9, seed=1), _tokens(30, seed=2)
    a = model(a_in, model.init_state(1)).state
    b = model(b_in, model.init_state(1)).state
    # cut a's memory down to its valid slots: a shorter memory, which the model must accept as it is
    short = State({k: v[:, -9:] for k, v in a.tensors.items()})
    stacked = State.stack([short, b])
    assert stacked.tensors["mask"].shape[1:] == b.tensors["mask"].shape[1:]  # left-padded to the longest
    assert stacked.tensors["mask"][0].sum() == 9
    assert_states_close(stacked.select(1), b, rtol=0, atol=0)
    nxt = _tokens(6, batch=2, seed=3)
    together = model(nxt, stacked)
    for row, state in enumerate([a, b]):
        alone = model(nxt[row : row + 1], state)
        torch.testing.assert_close(together.logits[row : row + 1], alone.logits, rtol=1e-5, atol=1e-6)
        assert_states_close(together.state.select(row), alone.state, rtol=1e-5, atol=1e-6)


def test_adapter_zero_is_no_adapter_and_row_b_touches_only_row_b() -> None:
    model = _model()
    x = _tokens(12, batch=3)
    plain = model(x, model.init_state(3)).logits
    zero = model(x, model.init_state(3), Adapter.zeros({"resid": 20}, 3)).logits
    torch.testing.assert_close(zero, plain, rtol=0, atol=0)
    m = torch.zeros(3, 20, 20)
    m[1] = 0.3 * torch.randn(20, 20, generator=torch.Generator().manual_seed(0))
    moved = model(x, model.init_state(3), Adapter({"resid": m})).logits
    torch.testing.assert_close(moved[[0, 2]], plain[[0, 2]], rtol=0, atol=0)
    assert not torch.allclose(moved[1], plain[1])


def test_adapter_gradient_equals_plain_autograd_of_h_plus_mh() -> None:
    """The site's per-position AdapterSteps gives dL/dM of h' = h + M h written out by hand."""
    model = _model()
    x, k = _tokens(10, batch=2), 12
    m = (0.1 * torch.randn(2, k, k, generator=torch.Generator().manual_seed(0))).requires_grad_(True)
    loss = model(x, model.init_state(2), Adapter({"resid": m})).logits.logsumexp(-1).sum()
    (grad,) = torch.autograd.grad(loss, [m])

    m2 = m.detach().clone().requires_grad_(True)
    captured: dict[str, torch.Tensor] = {}

    def hook(_module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        h = args[0]  # (B, T, D) the residual stream after the last block, before the adapter
        head = h[..., :k] + torch.einsum("bij,btj->bti", m2, h[..., :k])
        captured["h"] = h
        return (torch.cat([head, h[..., k:]], -1),)

    handle = model.ln_f.register_forward_pre_hook(hook)
    try:
        loss2 = model(x, model.init_state(2)).logits.logsumexp(-1).sum()
    finally:
        handle.remove()
    (grad2,) = torch.autograd.grad(loss2, [m2])
    torch.testing.assert_close(loss, loss2, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, grad2, rtol=1e-4, atol=1e-6)


# -- training and the checkpoint --------------------------------------------------------------------------


def test_training_lowers_the_loss(trained: tuple[Path, Any]) -> None:
    out, result = trained
    torch.manual_seed(1234)
    untrained = build_model(config_from_dict({"arch": "toy-transformer", **MODEL}))
    before = evaluate_bpb(untrained, VALID.read_bytes()[:2000], streams=4)
    assert before > 7.0  # near uniform over bytes
    assert result.best_valid_bpb < before - 1.0
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    train_bpb = [r["train_bpb"] for r in log if "train_bpb" in r]
    assert train_bpb[-1] < train_bpb[0] - 0.5


def test_checkpoint_loads_back_with_identical_logits_and_adapter_statistics(trained: tuple[Path, Any],
                                                                           ckpt: Checkpoint) -> None:
    assert isinstance(ckpt.model, ToyTransformer) and ckpt.config == ToyTransformerConfig(**MODEL)
    again = load_checkpoint(trained[0])
    x = torch.tensor([list(TEXT.encode())])
    torch.testing.assert_close(again.model(x, again.model.init_state(1)).logits,
                               ckpt.model(x, ckpt.model.init_state(1)).logits, rtol=0, atol=0)
    # an unfrozen copy (full dynamic evaluation's) computes the same function
    copy = ckpt.model.trainable_copy()
    torch.testing.assert_close(copy(x, copy.init_state(1)).logits, ckpt.model(x, ckpt.model.init_state(1)).logits,
                               rtol=0, atol=0)
    site = ckpt.model.adaptation_sites()[0]
    ms_g = ckpt.stats[f"adapter.{site.name}"]
    assert ms_g.shape == (site.dim, site.dim) and bool((ms_g > 0).any()) and bool(torch.isfinite(ms_g).all())
    assert all(f"param.{n}" in ckpt.stats for n, _ in ckpt.model.named_parameters())
    # the RMS rules can be built from them, as sessions do
    sparse = ckpt.dyneval.config("sparse")
    res = evaluate(ckpt.model, TEXT.encode(), sparse, stats=ckpt.stats)
    assert math.isfinite(res.bits) and res.adapted[site.name].abs().sum() > 0


def test_loaded_checkpoint_is_frozen(ckpt: Checkpoint) -> None:
    """Loaded for inference, the weights are constants: `freeze` once at load (a model's fast paths key on it)."""
    assert ckpt.model.frozen and not any(p.requires_grad for p in ckpt.model.parameters())


@dataclass(frozen=True)
class _BufferedConfig(ToyTransformerConfig):
    arch = "toy-transformer-buffered"


class _Buffered(ToyTransformer):
    """The toy with a derived, non-persistent buffer (as RoPE tables or ALiBi slopes usually are)."""

    def __init__(self, config: ToyTransformerConfig) -> None:
        super().__init__(config)
        self.register_buffer("scale", torch.ones(config.d_model), persistent=False)

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        out = super().forward(tokens, state, adapter)
        return Output(logits=out.logits * self.scale[0], state=out.state, hidden=out.hidden)


def test_a_model_with_a_non_persistent_buffer_loads(tmp_path: Path) -> None:
    register(_BufferedConfig, _Buffered)
    torch.manual_seed(0)
    model = _Buffered(_BufferedConfig(**MODEL)).eval()
    save_checkpoint(tmp_path / "ck", model)
    loaded = load_checkpoint(tmp_path / "ck").model
    x = _tokens(8)
    torch.testing.assert_close(loaded(x, loaded.init_state(1)).logits, model(x, model.init_state(1)).logits)


# -- scoring and sampling ---------------------------------------------------------------------------------


def test_score_bytes_equals_a_log_softmax_of_the_forward(ckpt: Checkpoint) -> None:
    data = TEXT.encode() * 3  # longer than the window; scored in chunks of 64 to carry the memory across calls
    scored = score_bytes(ckpt.model, data, logprobs=True, chunk=64)
    x = torch.tensor([[BOS, *data[:-1]]])
    with torch.no_grad():
        lp = torch.log_softmax(ckpt.model(x, ckpt.model.init_state(1)).logits[0], -1)
    manual = lp.gather(-1, torch.tensor(list(data)).unsqueeze(-1))[:, 0].double()
    assert scored.logprobs is not None
    np.testing.assert_allclose(scored.logprobs, manual.numpy(), rtol=1e-5, atol=1e-5)
    assert scored.bits == pytest.approx(-float(manual.sum()) / math.log(2), rel=1e-5)


def test_generation_with_a_seed_is_reproducible(ckpt: Checkpoint) -> None:
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    a = "".join(generate(ckpt.model, b"It is a ", params))
    b = "".join(generate(ckpt.model, b"It is a ", params))
    c = "".join(generate(ckpt.model, b"It is a ", SamplingParams(max_tokens=40, temperature=1.0, seed=8)))
    assert a == b and a != c
    greedy = "".join(generate(ckpt.model, b"It is a ", SamplingParams(max_tokens=20, temperature=0)))
    # greedy decoding is the argmax of the model's own forward, byte by byte
    ctx = [BOS, *b"It is a "]
    expected = []
    for _ in range(20):
        with torch.no_grad():
            nxt = int(ckpt.model(torch.tensor([ctx]), ckpt.model.init_state(1)).logits[0, -1].argmax())
        expected.append(nxt)
        ctx.append(nxt)
    assert greedy == bytes(expected).decode("utf-8", errors="replace")


# -- sparse dynamic evaluation ----------------------------------------------------------------------------


def test_sparse_dynamic_evaluation_lowers_the_bits_of_a_repetitive_text(ckpt: Checkpoint) -> None:
    static_later, sparse_later, static, sparse = sparse_bits_on_repeats(ckpt.model)
    assert sparse_later < 0.9 * static_later, (static_later, sparse_later)
    assert sparse.adapted["resid"].shape == (32, 32) and sparse.skipped_updates == sparse.adapter_resets == 0
    # no peeking: the first segment is scored before any update, so it equals static
    np.testing.assert_allclose(sparse.logprobs[:10], static.logprobs[:10], rtol=1e-5, atol=1e-6)


def test_evaluate_many_equals_each_text_alone(ckpt: Checkpoint) -> None:
    assert_evaluate_many_equals_each_text_alone(ckpt.model)


def _job(model: ToyTransformer, text: bytes, k: int, lr: float) -> TextJob:
    """An adapting row (k units, SGD at `lr`) and a scoring-only row reading the same text."""
    inputs, targets = ByteTokenizer().stream(text)
    rule = UpdateRule(DynEvalConfig(mode="sparse", rule="sgd", lr=lr), ["resid"])
    return TextJob(inputs, targets, [Row(model.init_state(1), {"resid": torch.zeros(k, k)}, rule),
                                     Row(model.init_state(1))])


def test_batch_step_across_jobs_with_different_adapter_sizes_equals_each_alone(ckpt: Checkpoint) -> None:
    specs = [(TEXT.encode(), 32, 0.3), (repetitive(47, seed=5), 8, 0.5), (repetitive(25, seed=6), 20, 0.1)]
    together = [_job(ckpt.model, *spec) for spec in specs]
    while running := [j for j in together if not j.done]:
        batch_step(ckpt.model, running, 10)
    for spec, job in zip(specs, together, strict=True):
        alone = _job(ckpt.model, *spec)
        while not alone.done:
            batch_step(ckpt.model, [alone], 10)
        for a, b in zip(job.rows, alone.rows, strict=True):
            torch.testing.assert_close(torch.cat(a.logprobs), torch.cat(b.logprobs), rtol=1e-5, atol=1e-5)
            assert_states_close(a.state, b.state, rtol=1e-4, atol=1e-5)
            assert (a.mats is None) == (b.mats is None)
            if a.mats is not None and b.mats is not None:
                assert a.mats["resid"].shape == (spec[1], spec[1])
                torch.testing.assert_close(a.mats["resid"], b.mats["resid"], rtol=1e-4, atol=1e-6)
                assert a.updates == b.updates == -(-len(spec[0]) // 10)
                assert a.mats["resid"].abs().sum() > 0
    # the adapting row learned: its scores differ from the scoring-only row's after the first segment
    rows = together[1].rows
    assert not torch.allclose(torch.cat(rows[0].logprobs)[10:], torch.cat(rows[1].logprobs)[10:])


# -- suggestions and the keyboard simulator ---------------------------------------------------------------


def _valid_completion(prefix: str, text: str, max_chars: int) -> bool:
    return text.startswith(prefix) and 0 < len(text) - len(prefix) <= max_chars and all(map(is_word_char, text))


def test_suggestions_are_valid_completions(ckpt: Checkpoint) -> None:
    context = TEXT[:40] + " th"
    cursor = advance(ckpt.model, ckpt.model.init_state(1), bytes([BOS]) + context.encode())
    found = suggest(ckpt.model, cursor, context, k=3, n_chars=4, min_prob=1e-4)
    assert found.prefix == "th" and 1 <= len(found.completions) <= 3
    assert all(_valid_completion("th", c.text, 24) for c in found.completions)
    probs = [c.prob for c in found.completions]
    assert probs == sorted(probs, reverse=True) and all(0 < p <= 1 for p in probs)
    assert 1 <= len(found.next_chars) <= 4 and sum(c.prob for c in found.next_chars) <= 1 + 1e-6
    # the most likely next character is the argmax of the model's own next-byte distribution (ASCII here)
    with torch.no_grad():
        x = torch.tensor([[BOS, *context.encode()]])
        lp = torch.log_softmax(ckpt.model(x, ckpt.model.init_state(1)).logits[0, -1], -1)
    top = int(lp[:128].argmax())
    if lp[top] >= lp[128:].max():
        assert found.next_chars[0].char == chr(top)
        assert found.next_chars[0].prob == pytest.approx(math.exp(float(lp[top])), rel=1e-4)


def test_keysim_with_sparse_adaptation_is_evaluate(ckpt: Checkpoint) -> None:
    config = DynEvalConfig(mode="sparse", rule="sgd", lr=0.3, segment=10)
    s = ModelSuggester(ckpt.model, config)
    message = TEXT + "\n"
    s.observe(message)
    ref = evaluate(ckpt.model, message.encode(), config)
    assert s.updates == -(-len(message) // 10)
    assert s.adapter is not None
    torch.testing.assert_close(s.adapter.mats["resid"][0], ref.adapted["resid"], rtol=1e-4, atol=1e-6)
    assert ref.state is not None
    assert_states_close(s.state, ref.state, rtol=1e-4, atol=1e-5)
    words = s.suggest("a tru", 3)
    assert words and all(_valid_completion("tru", w, 24) for w in words)
    cursor = advance(ckpt.model, s.state, bytes([message.encode()[-1]]) + b"a tru", s.adapter)
    assert words == [c.text for c in suggest(ckpt.model, cursor, "a tru", s.adapter, k=3, n_chars=0).completions]


# -- served: sessions over HTTP ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(trained: tuple[Path, Any]) -> Iterator[TestClient]:
    with served(trained[0]) as c:
        yield c


def test_session_bits_on_repeated_text_drop(client: TestClient, ckpt: Checkpoint) -> None:
    sid = create_session(client, adaptation={"lr": 0.5, "decay": 0.0})["id"]
    text = repetitive(100, seed=9).decode()
    first, second, third = (observe_text(client, sid, text) for _ in range(3))
    assert third["bits"] < 0.9 * third["static_bits"], (third, first)
    assert third["bits"] < first["bits"]
    assert first["static_bits"] == pytest.approx(score_bytes(ckpt.model, text.encode()).bits, rel=1e-5)


def test_session_export_import_round_trip(client: TestClient) -> None:
    source = create_session(client, initial_text=TEXT)
    blob = client.get(f"/v1/sessions/{source['id']}/state")
    assert blob.status_code == 200, blob.text
    target = "imported-toy-session-0123456789"
    put = client.put(f"/v1/sessions/{target}/state", content=blob.content,
                     headers={"content-type": "application/octet-stream"})
    assert put.status_code == 200, put.text
    assert put.json()["stats"] == source["stats"]
    a, b = observe_text(client, target, "a single man"), observe_text(client, source["id"], "a single man")
    assert a["bits"] == b["bits"] and a["updates"] == b["updates"]


def _exported(client: TestClient, sid: str) -> tuple[State, Adapter, int]:
    """A session's state, adapter and last byte, read from its export (the architecture's own tensor names)."""
    blob = client.get(f"/v1/sessions/{sid}/state")
    assert blob.status_code == 200, blob.text
    tensors = safetensors_load(blob.content)
    header = json.loads(blob.content[8 : 8 + int.from_bytes(blob.content[:8], "little")])
    meta = json.loads(header["__metadata__"]["session"])
    return State.from_tensors(tensors, "state."), Adapter(State.from_tensors(tensors, "adapter.").tensors), \
        int(meta["last_token"])


def test_session_suggest_and_generate_use_the_sessions_state_and_adapter(client: TestClient,
                                                                         ckpt: Checkpoint) -> None:
    sid = create_session(client, initial_text=TEXT, adaptation={"lr": 0.5})["id"]
    state, adapter, last = _exported(client, sid)
    assert set(state.tensors) == set(ckpt.model.init_state(1).tensors) and adapter.mats["resid"].abs().sum() > 0
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "a tru", "k": 3, "n_chars": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    cursor = advance(ckpt.model, state, bytes([last]) + b"a tru", adapter)
    expected = suggest(ckpt.model, cursor, "a tru", adapter, k=3, n_chars=3)
    assert [w["text"] for w in body["completions"]] == [c.text for c in expected.completions]
    assert all(_valid_completion("tru", w["text"], 24) for w in body["completions"])
    assert [c["char"] for c in body["next_chars"]] == [c.char for c in expected.next_chars]
    gen = {"prompt": " It", "max_tokens": 20, "temperature": 0.8, "seed": 3, "session_id": sid}
    a = client.post("/v1/generate", json=gen)
    assert a.status_code == 200, a.text
    reference = "".join(generate(ckpt.model, b" It", SamplingParams(max_tokens=20, temperature=0.8, seed=3),
                                 state=state, last_token=last, adapter=adapter))
    assert a.json()["text"] == reference
    plain = client.post("/v1/generate", json={k: v for k, v in gen.items() if k != "session_id"})
    assert plain.status_code == 200 and plain.json()["text"] != reference


def test_two_sessions_batched_equal_each_alone(client: TestClient) -> None:
    texts = [TEXT, repetitive(77, seed=4).decode()]
    alone = [observe_text(client, create_session(client)["id"], t) for t in texts]
    ids = [create_session(client)["id"] for _ in texts]
    engine = client.app.state.engine  # type: ignore[attr-defined]
    before = dict(engine.stats.batch_rows)
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda it: observe_text(client, *it), zip(ids, texts, strict=True)))
    after = engine.stats.batch_rows
    for a, b in zip(alone, together, strict=True):
        assert b["bits"] == pytest.approx(a["bits"], rel=1e-5)
        assert b["static_bits"] == pytest.approx(a["static_bits"], rel=1e-5)
        assert b["updates"] == a["updates"]
    # some step of the two observes ran both sessions' rows in one call
    assert any(rows > 2 and n > before.get(rows, 0) for rows, n in after.items()), (before, after)
