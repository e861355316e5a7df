"""Locust load tests against a running server (HTTP only)."""
