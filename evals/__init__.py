"""Evaluation helpers (synthetic long-memory documents, ...)."""
