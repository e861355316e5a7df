"""A load builds the model as an uninitialised skeleton (models/_skeleton.py): no torch._dynamo import, no RNG draw."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from models.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[2]
SHIPPED = [p.name for p in sorted((REPO / "checkpoints").iterdir()) if (p / "config.json").is_file()]

# every shipped checkpoint loaded and copied for full dynamic evaluation, and every architecture (each compression
# of the compressive transformer) built as a skeleton, in one fresh process
_PROBE = """
import sys
from models._skeleton import skeleton
from models.checkpoint import load_checkpoint
from models.compressive import COMPRESSIONS, CompressiveConfig, CompressiveTransformer
from models.registry import REGISTRY
for name in sys.argv[1:]:
    load_checkpoint("checkpoints/" + name).model.trainable_copy()
with skeleton():
    for config_cls, model_cls in REGISTRY.values():
        model_cls(config_cls())
    for mode in COMPRESSIONS:
        CompressiveTransformer(CompressiveConfig(compression=mode))
print("torch._dynamo" in sys.modules)
"""


def test_loading_and_copying_never_import_dynamo() -> None:
    # torch._dynamo costs 1.3-2.3 s of CPU to import: every server, CLI and worker process would pay it at load
    assert {"default", "words"} <= set(SHIPPED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "clients")]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PROBE, *SHIPPED], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", out.stdout


def test_a_load_draws_nothing_from_the_global_rng_and_keeps_the_files_tensors() -> None:
    for name in ("default", "words"):
        torch.manual_seed(11)
        expected = torch.rand(8)
        torch.manual_seed(11)
        ckpt = load_checkpoint(REPO / "checkpoints" / name)
        assert torch.equal(torch.rand(8), expected), name  # seed, load, draw == seed, draw
        torch.manual_seed(11)
        copy = ckpt.model.trainable_copy()
        assert torch.equal(torch.rand(8), expected), name
        saved = load_file(str(REPO / "checkpoints" / name / "model.safetensors"))
        for model in (ckpt.model, copy):
            state = model.state_dict()
            assert set(state) == set(saved), name
            for k, v in saved.items():
                assert state[k].dtype == torch.float32 and state[k].device.type == "cpu", k
                assert torch.equal(state[k], v.float()), k
            assert not any(t.is_meta for t in (*model.parameters(), *model.buffers())), name
        assert all(p.requires_grad for p in copy.parameters()) and not any(p.requires_grad
                                                                           for p in ckpt.model.parameters())
