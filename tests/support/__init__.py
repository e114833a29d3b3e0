"""Shared helpers for the test-suite: fetching real upstream files, fake packages, real-stack venvs."""
