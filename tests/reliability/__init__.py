"""Reliability tests: a real coordinator under random and hostile input (hypothesis)."""
