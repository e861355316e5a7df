"""Training throughput (tokens/s) of the mLSTM: our model against a plain per-timestep PyTorch loop.

The baseline is the same cell written the obvious way: nn.Linear layers with PyTorch's weight-norm
parametrisation (weights recomputed at every use), every projection computed inside the time loop.
Ours hoists the input projections out of the loop (two matmuls per step), normalises weights once per
chunk, runs larger batches and bf16 autocast for the matmuls. Same machine, same run, same H and E.

    python -m bench.train_throughput [--hidden 768 --embed 128 --steps 3]  (default preset sizes)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from bench._common import machine_line
from models.mlstm import MLSTM, MLSTMConfig


class PlainMLSTM(nn.Module):
    def __init__(self, E: int, H: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, E)
        self.w_mx = weight_norm(nn.Linear(E, H, bias=False))
        self.w_mh = weight_norm(nn.Linear(H, H, bias=False))
        self.w_x = weight_norm(nn.Linear(E, 4 * H))
        self.w_m = weight_norm(nn.Linear(H, 4 * H, bias=False))
        self.head = weight_norm(nn.Linear(H, 256))
        self.H = H

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        h = c = torch.zeros(B, self.H)
        outs = []
        for t in range(T):
            x = self.embed(tokens[:, t])
            m = self.w_mx(x) * self.w_mh(h)
            i, f, o, u = (self.w_x(x) + self.w_m(m)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(self.head(h))
        return torch.stack(outs, 1)


def tokens_per_s(step: callable, batch: int, bptt: int, steps: int) -> float:  # type: ignore[valid-type]
    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * bptt * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--embed", type=int, default=128)
    ap.add_argument("--bptt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    H, E, T = args.hidden, args.embed, args.bptt

    def make_step(model: nn.Module, batch: int, bf16: bool, ours: bool) -> callable:  # type: ignore[valid-type]
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        x = torch.randint(0, 256, (batch, T + 1))

        def step() -> None:
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
            with ctx:
                logits = model(x[:, :-1], model.init_state(batch)).logits if ours else model(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()

        return step

    rows = []
    base = tokens_per_s(make_step(PlainMLSTM(E, H), 32, False, False), 32, T, args.steps)
    rows.append(("plain per-timestep loop", 32, "fp32", base))
    for batch, bf16 in [(32, False), (64, False), (64, True), (128, True)]:  # 64 + bf16: the default preset
        model = MLSTM(MLSTMConfig(hidden=H, embed_dim=E, dropout_hidden=0.05)).train()
        tps = tokens_per_s(make_step(model, batch, bf16, True), batch, T, args.steps)
        rows.append(("adaptlm MLSTM", batch, "bf16 autocast" if bf16 else "fp32", tps))
    print(f"# training throughput, mLSTM H={H} E={E} bptt={T}: {machine_line()}")
    print("| implementation | batch | precision | tokens/s | vs baseline |")
    print("| --- | ---: | --- | ---: | ---: |")
    for name, batch, prec, tps in rows:
        print(f"| {name} | {batch} | {prec} | {tps:,.0f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    main()
