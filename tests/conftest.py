"""Shared fixtures. The test process is never monkey-patched (docs/ARCHITECTURE.md)."""
