"""Serving: turns a validated request into engine work, and the engine's events into a response or a stream
(vLLM's `serving_*` layer). Routes only validate and call these; no model math here."""

from server.serving import _sessions as sessions
from server.serving._common import Context
from server.serving._completions import create_completion
from server.serving._generate import create_generation
from server.serving._score import create_score

__all__ = ["Context", "create_completion", "create_generation", "create_score", "sessions"]
