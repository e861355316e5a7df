"""Offline trainer: data, training loop, MS_g statistics."""
