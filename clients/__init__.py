"""Python SDK for the adaptlm HTTP API (HTTP only: never imports torch)."""
