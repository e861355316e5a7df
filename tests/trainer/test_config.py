"""trainer/config.py: what a preset, a config file and flags may set, and what is refused before training starts."""

import math

import pytest

from trainer.config import ARCH_PRESETS, PRESETS, make_config


def test_every_preset_is_a_valid_config() -> None:
    for name in PRESETS:
        make_config(name)
    for arch, table in ARCH_PRESETS.items():
        for name in table:
            assert make_config(name, {"arch": arch}).arch == arch


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"lr": math.nan}, "lr must be a finite number"),
        ({"lr": math.inf}, "lr must be a finite number"),
        ({"lr": 0.0}, "lr must be positive"),
        ({"lr": -1e-3}, "lr must be positive"),
        ({"lr_final": -1e-3}, "lr_final must be >= 0"),
        ({"lr": 1e38}, "lr must be <= 10000"),  # Adam's step would overflow float32 (a traceback before)
        ({"lr_final": 2e4}, "lr_final must be <= 10000"),
        ({"clip": 0.0}, "clip must be positive"),
        ({"max_minutes": -1.0}, "max_minutes must be >= 0"),
        ({"max_minutes": math.nan}, "max_minutes must be a finite number"),
        ({"log_every": 0}, "log_every must be positive"),
        ({"stats_batches": 0}, "stats_batches must be positive"),
        ({"stats_batch_size": 0}, "stats_batch_size must be positive"),
        ({"threads": -2}, "threads must be >= 0"),
        ({"valid_bytes": -5}, "valid_bytes must be >= 0"),
        ({"batch_size": "8"}, "batch_size must be an integer"),
        ({"max_steps": 1e9}, "max_steps must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"max_steps": True}, "max_steps must be an integer"),
        ({"variable_bptt": 1}, "variable_bptt must be true or false"),
        ({"schedule": 3}, "schedule must be a string"),
        ({"tokenizer": "words"}, "tokenizer must be a table"),
    ],
)
def test_bad_numbers_and_types_are_refused(setting: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config("tiny", setting)


def test_a_float_setting_may_be_written_as_an_integer() -> None:
    cfg = make_config("tiny", {"max_minutes": 2, "lr": 1})
    assert cfg.max_minutes == 2 and cfg.lr == 1
