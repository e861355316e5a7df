"""bench.capacity's arguments and its users-held line, and the balancer configuration it shares with
tests/deploy/test_replicas.py (bench/_replicas.py); the topology itself runs in that test."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._replicas import TEMPLATE, render, replicas_on_loopback
from bench.capacity import held, parse_args


def test_replicas_are_started_here_not_with_a_url() -> None:
    assert parse_args(["--replicas", "2", "--classes", "Typist", "--levels", "2,4"]).replicas == 2
    assert parse_args([]).replicas == 0 and parse_args([]).p99_ms == 30.0
    for wrong in (["--replicas", "2", "--url", "http://127.0.0.1:8000"], ["--replicas", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(wrong)
        assert exit_.value.code == 2
    with pytest.raises(ValueError, match="at least 1"), replicas_on_loopback("checkpoint", 0, Path("/nonexistent")):
        pass


def test_users_held_stop_at_the_first_level_over_the_target() -> None:
    assert held([(4, 28.0), (2, 12.0), (8, 31.0), (16, 29.0)], 30.0) == 4  # 16 met it after 8 missed: not held
    assert held([(2, 31.0), (4, 20.0)], 30.0) == 0
    assert held([(10, 30.0)], 30.0) == 10
    assert held([], 30.0) == 0


def test_the_balancer_template_is_filled_with_exactly_its_placeholders() -> None:
    template = TEMPLATE.read_text()
    conf = render(template, BALANCER_PORT="127.0.0.1:1", BALANCER_SERVERS="server 127.0.0.1:2;")
    assert "listen 127.0.0.1:1;" in conf and "server 127.0.0.1:2;" in conf
    assert "${BALANCER_PORT}" not in conf and "${BALANCER_SERVERS}" not in conf
    assert "$adaptlm_balance_key" in conf  # nginx's own variables stay
    with pytest.raises(ValueError, match="placeholders"):
        render(template, BALANCER_PORT="1")
