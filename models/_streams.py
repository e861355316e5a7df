"""What every tokenizer derives from its `encode_tensor` and `bos` (models/tokenizer.py, models/word_tokenizer.py)."""

from __future__ import annotations

import torch

__all__ = ["StreamMixin"]


class StreamMixin:
    bos: int

    def encode_tensor(self, data: str | bytes, device: torch.device | str = "cpu") -> torch.Tensor:
        raise NotImplementedError

    def stream(self, data: str | bytes, last_token: int | None = None,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """-> inputs, targets (T,): every token of `data` is predicted, the first one from `last_token` (the
        stream's previous input; None: `bos`, a stream's start)."""
        targets = self.encode_tensor(data)  # (T,) on the host, then both to the device in copies that do not wait for
        # its queue (a blocking copy to a GPU waits for everything queued there: a text's start in a busy engine)
        first = targets.new_tensor([self.bos if last_token is None else last_token])
        inputs = torch.cat([first, targets[:-1]])
        return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
