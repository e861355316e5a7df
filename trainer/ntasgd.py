"""NT-ASGD and variable-length BPTT, the AWD-LSTM's optimisation (Merity et al. 2018, sec. 3-4; docs/algorithms.md §5).

    nt = NTASGD(model, lr=30.0, nonmono=5, interval=steps_per_epoch, weight_decay=1.2e-6)
    for start, seq_len, lr_scale in bptt_chunks(n_tokens, bptt=70, rng=random.Random(seed)):
        ... loss.backward(); clip the gradient norm (0.25)
        nt.step(lr_scale)                   # SGD (eq. 1), then the running average once it is on
        if nt.check_due():
            with nt.averaged():             # the average, once averaging started; else the weights as they are
                v = validation_loss(model)
            nt.check(v)                     # Algorithm 1 lines 5-10: may switch averaging on
    save(nt.averaged_state_dict())          # what the checkpoint keeps
    nt.restart()                            # fine-tuning (sec. 5): ASGD hot-started from the average, T = 0,
                                            # until the same criterion fires again (`nt.finished`)

The trigger (Algorithm 1 line 6): at the t-th check (t = 0, 1, ...; logs = the t losses before it), averaging
starts when t > n and v > min(logs[0 .. t-n-1]), i.e. the loss is worse than the best of all the checks but the
last n. That is the authors' public code (`len(logs) > n and v > min(logs[:-n])`) and docs/algorithms.md §5; the
index set of the paper's Algorithm 1 is ambiguous as typeset, so the rule follows the code. Equal is not worse.

The average is the paper's 1/(k-T+1) * sum_{i=T..k} w_i: the weights at the check that switched it on, then every
iterate after each later step (a running mean, in the parameters' dtype). Buffers are not averaged.

Nothing here reads trainer/train.py: wiring it into the trainer and the CLI is separate work.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["NTASGD", "bptt_chunks", "sample_seq_len", "scaled_lr"]


class NTASGD:
    """Plain SGD on `model`'s trainable parameters with Algorithm 1's non-monotonically triggered averaging.

    `interval` is the logging interval L in optimizer steps (the paper: one epoch); `nonmono` is n (5). The caller
    clips gradients and evaluates; this class owns the SGD step, the trigger, the average and the swap."""

    def __init__(self, model: nn.Module, lr: float, *, nonmono: int = 5, interval: int = 1,
                 weight_decay: float = 0.0) -> None:
        if lr <= 0 or nonmono < 0 or interval < 1 or weight_decay < 0:
            raise ValueError("need lr > 0, nonmono >= 0, interval >= 1 and weight_decay >= 0")
        self.model = model
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.lr = lr
        self.nonmono = nonmono
        self.interval = interval
        self.optimizer = torch.optim.SGD(list(self.params.values()), lr=lr, weight_decay=weight_decay)
        self.steps = 0  # k
        self.logs: list[float] = []  # the validation losses Algorithm 1 compares against
        self.switched_at: int | None = None  # T: the step count when averaging began (None: plain SGD)
        self.finetuning = False
        self.finished = False  # fine-tuning's stopping criterion fired
        self._avg: dict[str, torch.Tensor] | None = None
        self._count = 0  # iterates in the average

    @property
    def averaging(self) -> bool:
        return self._avg is not None

    def step(self, lr_scale: float = 1.0) -> None:
        """One SGD step (eq. 1) at lr * lr_scale (variable-length BPTT's seq_len / bptt, sec. 4.1), then the new
        iterate joins the average if averaging is on."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * lr_scale
        self.optimizer.step()
        self.steps += 1
        if self._avg is not None:
            self._count += 1
            with torch.no_grad():
                for name, p in self.params.items():
                    avg = self._avg[name]
                    avg.add_(p.detach() - avg, alpha=1.0 / self._count)  # running mean of w_T .. w_k

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def check_due(self) -> bool:
        """Whether this step ends a logging interval (Algorithm 1 line 4: mod(k, L) = 0, counted after the step)."""
        return self.steps > 0 and self.steps % self.interval == 0

    def criterion(self, val_loss: float) -> bool:
        """Algorithm 1 line 6 on the logs so far: t > n and v > min_{l < t-n} logs[l] (module docstring)."""
        t = len(self.logs)
        return t > self.nonmono and val_loss > min(self.logs[: t - self.nonmono])

    def check(self, val_loss: float) -> bool:
        """Record one validation loss (Algorithm 1 lines 5-10) -> whether the criterion fired. Before averaging it
        switches averaging on (T <- k) from the current weights; once averaging is on the paper checks no more,
        so the loss is ignored; while fine-tuning it sets `finished` (the sec. 5 stopping rule)."""
        if self.averaging and not self.finetuning:
            return False
        fired = self.criterion(val_loss)
        if fired:
            if self.finetuning:
                self.finished = True
            else:
                self._start_average()
        self.logs.append(float(val_loss))
        return fired

    def _start_average(self) -> None:
        self.switched_at = self.steps
        self._avg = {n: p.detach().clone() for n, p in self.params.items()}
        self._count = 1

    @contextmanager
    def averaged(self) -> Iterator[None]:
        """Run the body with the averaged weights in the model (the same parameter tensors, values copied in),
        the training iterate restored afterwards, also on an exception. Before averaging: the weights as they
        are."""
        if self._avg is None:
            yield
            return
        with torch.no_grad():
            kept = {n: p.detach().clone() for n, p in self.params.items()}
            for n, p in self.params.items():
                p.copy_(self._avg[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(kept[n])

    def averaged_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the averaged weights (ASGD's solution: what a checkpoint saves); the
        current weights before averaging started. Copies: the model is left as it was."""
        with self.averaged():
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def restart(self) -> None:
        """Fine-tuning (sec. 5): ASGD with T = 0 hot-started from the averaged weights: the model takes the
        average, which restarts from it alone; the logs start empty, and the same criterion then ends it."""
        if self._avg is not None:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(self._avg[n])
        self.logs = []
        self.finetuning = True
        self.finished = False
        self._start_average()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (the model's weights are the model's): counters, logs, the average."""
        return {"steps": self.steps, "logs": list(self.logs), "switched_at": self.switched_at,
                "finetuning": self.finetuning, "finished": self.finished, "count": self._count, "lr": self.lr,
                "average": None if self._avg is None else {n: a.clone() for n, a in self._avg.items()},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.logs = int(state["steps"]), [float(v) for v in state["logs"]]
        self.switched_at, self.finetuning = state["switched_at"], bool(state["finetuning"])
        self.finished, self._count, self.lr = bool(state["finished"]), int(state["count"]), float(state["lr"])
        avg = state["average"]
        self._avg = None if avg is None else {n: avg[n].to(p).clone() for n, p in self.params.items()}
        self.optimizer.load_state_dict(state["optimizer"])


def sample_seq_len(bptt: int, rng: random.Random, *, p: float = 0.95, std: float = 5.0, min_len: int = 5,
                   max_len: int | None = None) -> int:
    """Variable-length BPTT (sec. 4.1): base bptt with probability p, else bptt / 2; then N(base, std), truncated
    to an integer, at least `min_len` (and at most `max_len` if given), as the authors' code draws it."""
    base = bptt if rng.random() < p else bptt / 2
    seq_len = max(min_len, int(rng.gauss(base, std)))
    return seq_len if max_len is None else min(seq_len, max_len)


def scaled_lr(lr: float, seq_len: int, bptt: int) -> float:
    """The learning rate for a sequence of seq_len tokens (sec. 4.1: rescaled linearly by seq_len / bptt)."""
    return lr * seq_len / bptt


def bptt_chunks(n_tokens: int, bptt: int, rng: random.Random, **sample: Any) -> Iterator[tuple[int, int, float]]:
    """Contiguous chunks of a stream of `n_tokens` tokens (inputs tokens[s : s+L], targets tokens[s+1 : s+1+L])
    -> (start s, length L, lr scale L / bptt). Each L is drawn by `sample_seq_len` (keyword options passed on) and
    cut at the stream's end. Decision: the scale uses the length actually used, so a cut last chunk weighs what it
    holds (the authors' code scales by the drawn length)."""
    start = 0
    while start < n_tokens - 1:
        length = min(sample_seq_len(bptt, rng, **sample), n_tokens - 1 - start)
        yield start, length, length / bptt
        start += length
