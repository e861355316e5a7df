"""A session's adaptation does not depend on what else is batched with it: the same text, observed in the same
pieces, gives the same adapter and state alone and inside batches of other sessions of other lengths, under the
bf16 precision (`ADAPTLM_PRECISION=bfloat16`, what `auto` picks on a CPU with AVX-512 BF16 or AMX).

Why a margin and not bitwise: the update path runs in float32 (models/adaptation/_sparse.py), whose matmuls still
accumulate in an order that depends on their row count (MKL picks kernels by shape), and the time axis of a batch is
cut where its rows end; that is float32's last bits, about 1e-7 relative an operation, 5e-7 of the adapter's largest
entry after these segments (measured). bf16 rounding is 2^-8 = 4e-3 relative, and the adaptation carries each flipped
rounding on: 5e-3 of the largest entry after the same segments. The margin, 2e-5, sits between the two.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from models.adaptation import AdapterMemory, Row, TextJob, UpdateRule, batch_step
from models.base import LanguageModel, State
from models.checkpoint import load_checkpoint
from models.precision import inference_precision

TEXT = (b"It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        b"of a wife. However little known the feelings or views of such a man may be")
RTOL = 2e-5
DEFAULT = Path(__file__).resolve().parents[2] / "checkpoints" / "default"


@pytest.fixture(scope="module")
def adapting() -> tuple[LanguageModel, UpdateRule, int, int]:
    """The default checkpoint's model (an mLSTM, trained: a random one's small gradients hide the bf16 rounding),
    the update rule, adapter size and segment of its sessions' M (at the checkpoint's settings: M is off by default
    there, and a session that asks for it gets these)."""
    ckpt = load_checkpoint(DEFAULT)
    memory = AdapterMemory.build(ckpt)
    assert memory is not None
    settings = memory.initial_settings()
    return ckpt.model, memory.rule(settings), settings.size, memory.base.segment


def _job(adapting: tuple[LanguageModel, UpdateRule, int, int], data: bytes, state: State | None = None,
         mats: dict[str, torch.Tensor] | None = None) -> TextJob:
    model, rule, size, _ = adapting
    tokens = torch.tensor(list(data), dtype=torch.long)
    row = Row(state if state is not None else model.init_state(1),
              mats if mats is not None else {"h": torch.zeros(size, size)}, rule)
    return TextJob(tokens[:-1], tokens[1:], [row, Row(model.init_state(1))])  # with an unadapted shadow, as a session


def _observe(adapting: tuple[LanguageModel, UpdateRule, int, int], pieces: list[bytes], others: list[list[bytes]]
             ) -> Row:
    """The session's row after observing `pieces` one after the other, piece i batched with the texts others[i]."""
    state, mats = None, None
    model, segment = adapting[0], adapting[3]
    for piece, batch in zip(pieces, others, strict=True):
        jobs = [_job(adapting, piece, state, mats), *(_job(adapting, t) for t in batch)]
        with torch.no_grad(), inference_precision("bfloat16", torch.device("cpu")):
            while not jobs[0].done:
                batch_step(model, [j for j in jobs if not j.done], segment)
        row = jobs[0].rows[0]
        state, mats = row.state, row.mats
    return jobs[0].rows[0]


def _texts(rng: random.Random, n: int, low: int, high: int) -> list[bytes]:
    letters = b"abcdefghijklmnopqrstuvwxyz ,."
    return [bytes(rng.choice(letters) for _ in range(rng.randint(low, high))) for _ in range(n)]


def test_a_sessions_adapter_does_not_depend_on_its_batch(adapting: tuple[LanguageModel, UpdateRule, int, int],
                                                         one_thread: None) -> None:
    pieces = [TEXT[:57], TEXT[57:]]  # the text in two observes, each of several segments
    rng = random.Random(0)
    alone = _observe(adapting, pieces, [[], []])
    assert alone.updates == 2 + 5 and not alone.dropped and not alone.resets
    assert alone.mats is not None
    scale = float(alone.mats["h"].abs().max())
    assert scale > 1e-3  # the adapter learned something
    # other sessions of other lengths (the batch's time axis is cut where a row ends, and padded to its longest) and
    # more rows (other matmul kernels than one row's: oneDNN's bf16 ones change at 8 rows on a CPU with AMX)
    batches = [
        [_texts(rng, 3, 5, 40), _texts(rng, 3, 5, 40)],  # 4 sessions, the others shorter than each piece
        [_texts(rng, 7, 60, 200), _texts(rng, 7, 130, 200)],  # 8 sessions, the others longer
    ]
    for others in batches:
        batched = _observe(adapting, pieces, others)
        assert batched.mats is not None and batched.updates == alone.updates
        diff = float((batched.mats["h"] - alone.mats["h"]).abs().max())
        assert diff <= RTOL * scale, f"adapter off by {diff:.3g} ({diff / scale:.2g} of its largest entry)"
        for key, value in alone.state.tensors.items():
            torch.testing.assert_close(batched.state.tensors[key], value, rtol=RTOL, atol=RTOL)  # |h|, |c| ~ 1
