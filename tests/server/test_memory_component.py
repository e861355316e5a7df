"""A session memory defined and registered here, in the test, is served like the shipped ones with no change to
server/, clients/ or the protocol: a unigram count of the session's tokens, mixed into its next-token distribution.

It is turned on per session over HTTP (`adaptation.memories`), observed in a batch with other sessions, read by the
keyboard search, exported, imported into another server, kept in Redis (a second server on the same Redis reads it)
and reset.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load as load_tensors

from models.base import State
from models.checkpoint import Checkpoint
from models.memory import Learned, Memory, MemorySettings, NoSettings, register, unregister
from server.settings import Settings

V_ALPHA = 0.5  # add-alpha smoothing of the counts
WEIGHT = 0.5  # the mixture's weight of the unigram distribution


class UnigramMemory(Memory):
    """p(x) = (1 - w) p_model(x) + w (n(x) + a) / (N + V a), n the counts of the tokens the session observed."""

    name = "unigram"
    kind = "distribution"

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    @classmethod
    def build(cls, ckpt: Checkpoint) -> UnigramMemory:
        return cls(ckpt.tokenizer.vocab_size)

    def init(self, settings: MemorySettings, device: torch.device) -> State:
        return State({"counts": torch.zeros(1, self.vocab, device=device)})

    def restore(self, settings: MemorySettings, tensors: dict[str, torch.Tensor], meta: Any,
                device: torch.device) -> State:
        counts = tensors.get("counts")
        if counts is None or set(tensors) != {"counts"} or counts.shape != (1, self.vocab) \
                or not bool((counts >= 0).all()):
            raise ValueError("a unigram memory is counts (1, V) >= 0")
        return State({"counts": counts.to(device)})

    def _mix(self, log_dist: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        p = (counts + V_ALPHA) / (counts.sum(-1, keepdim=True) + self.vocab * V_ALPHA)
        return torch.logaddexp(log_dist.float() + math.log(1 - WEIGHT), p.log() + math.log(WEIGHT))

    def learn(self, log_dist: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              hidden: torch.Tensor | None, states: Sequence[Any]) -> Learned:
        start = torch.cat([s.tensors["counts"] for s in states])  # (B, V)
        seen = torch.nn.functional.one_hot(targets, self.vocab).float() * mask.unsqueeze(-1)  # (B, T, V)
        before = start.unsqueeze(1) + seen.cumsum(1) - seen  # (B, T, V) counts before each target
        after = start + seen.sum(1)
        return Learned(self._mix(log_dist, before), [State({"counts": after[b : b + 1]}) for b in range(len(states))])

    def read(self, log_dist: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor | None,
             branch: State | None, views: Sequence[Any], index: torch.Tensor) -> tuple[torch.Tensor, State | None]:
        counts = torch.cat([v.tensors["counts"] for v in views])[index.clamp(min=0)]  # (B, V)
        mixed = self._mix(log_dist, counts.unsqueeze(1))
        return torch.where((index >= 0).view(-1, 1, 1), mixed, log_dist), None


@pytest.fixture(scope="module")
def unigram() -> Iterator[None]:
    register(UnigramMemory)
    yield
    unregister(UnigramMemory.name)


def _create(client: httpx.Client, memories: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"adaptation": {"memories": memories}} if memories is not None else {}
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def _observe(client: httpx.Client, sid: str, text: str) -> dict[str, Any]:
    r = client.post(f"/v1/sessions/{sid}/observe", json={"text": text})
    assert r.status_code == 200, r.text
    return r.json()


TEXT = "zzzz qqqq zzzz qqqq zzzz qqqq zzzz qqqq zzzz " * 4


def test_a_memory_registered_here_is_served_batched_exported_stored_and_reset(
        unigram: None, serve_app: Any, tiny_checkpoint: Path, redis_url: str) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_url, suggest_budget_ms=0)
    with serve_app(settings) as a, httpx.Client(base_url=a.url, timeout=120) as ca:
        with_memory = _create(ca, {"unigram": {}})
        plain = _create(ca)
        assert with_memory["adaptation"]["memories"]["unigram"] == {}  # on, with no settings of its own
        assert "unigram" not in plain["adaptation"]["memories"]  # off unless asked for
        assert with_memory["state_bytes"] == plain["state_bytes"] + 256 * 4  # its counts, (1, V) float32

        # both sessions observe at once: the engine batches them into one step
        before = dict(a.app.state.engine._stats.batch_rows)
        results: dict[str, dict[str, Any]] = {}
        threads = [threading.Thread(target=lambda s=s: results.__setitem__(s, _observe(ca, s, TEXT)))
                   for s in (with_memory["id"], plain["id"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = a.app.state.engine._stats.batch_rows
        assert any(rows >= 4 and after[rows] > before.get(rows, 0) for rows in after)  # 2 sessions x (adapted, static)
        # the repeated letters are predicted from the counts: far fewer bits than the same session without them
        assert results[with_memory["id"]]["bits"] < 0.8 * results[plain["id"]]["bits"]
        assert results[with_memory["id"]]["static_bits"] == pytest.approx(results[plain["id"]]["static_bits"])

        # the keyboard search reads it: after "zz", "zzzz" is the first completion
        r = ca.post(f"/v1/sessions/{with_memory['id']}/suggest", json={"context": "zz", "k": 3})
        assert r.status_code == 200, r.text
        assert r.json()["completions"][0]["text"].startswith("zzz")

        # exported, with its counts
        blob = ca.get(f"/v1/sessions/{with_memory['id']}/state").content
        counts = load_tensors(blob)["unigram.counts"]
        assert int(counts.sum()) == len(TEXT.encode())  # every byte it scored
        assert int(counts[0, ord("z")]) == TEXT.count("z") and int(counts[0, ord("q")]) == TEXT.count("q")

        # kept in Redis: another server on the same Redis reads the session, memory and all
        with serve_app(settings) as a2, httpx.Client(base_url=a2.url, timeout=120) as ca2:
            again = ca2.get(f"/v1/sessions/{with_memory['id']}").json()
            assert again["adaptation"]["memories"] == with_memory["adaptation"]["memories"]
            assert again["state_bytes"] == ca.get(f"/v1/sessions/{with_memory['id']}").json()["state_bytes"]
            assert again["stats"]["bits"] == pytest.approx(results[with_memory["id"]]["bits"])

        # imported into a server with another store: it scores the next text as the original does
        with serve_app(Settings(checkpoint=tiny_checkpoint, suggest_budget_ms=0)) as b, \
                httpx.Client(base_url=b.url, timeout=120) as cb:
            sid = "u" * 32
            r = cb.put(f"/v1/sessions/{sid}/state", content=blob,
                       headers={"content-type": "application/octet-stream"})
            assert r.status_code in (200, 201), r.text
            more = "zzzz qqqq zz"
            assert _observe(cb, sid, more)["bits"] == pytest.approx(_observe(ca, with_memory["id"], more)["bits"],
                                                                    rel=1e-5)

        # reset: the memory stays on, its counts start again
        r = ca.post(f"/v1/sessions/{with_memory['id']}/reset")
        assert r.status_code == 200, r.text
        assert r.json()["adaptation"]["memories"]["unigram"] == {}
        counts = load_tensors(ca.get(f"/v1/sessions/{with_memory['id']}/state").content)["unigram.counts"]
        assert not bool(counts.any())

        # a memory the model does not have, or settings it does not take, are a 422 on their field
        r = ca.post("/v1/sessions", json={"adaptation": {"memories": {"bigram": {}}}})
        assert r.status_code == 422 and r.json()["error"]["param"] == "adaptation.memories.bigram"
        r = ca.post("/v1/sessions", json={"adaptation": {"memories": {"unigram": {"weight": 2}}}})
        assert r.status_code == 422 and r.json()["error"]["param"] == "adaptation.memories.unigram.weight"


def test_no_settings_type_takes_no_settings() -> None:
    with pytest.raises(ValueError):
        NoSettings.model_validate({"weight": 1})
