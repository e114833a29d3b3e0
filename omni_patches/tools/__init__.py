"""Offline tools (never imported by a serving process): ``omni-patches audit`` reads the release files of
upstream versions without installing them -- :mod:`.audit` (verdicts), :mod:`.skeleton` (import a target from
its files alone), :mod:`.index` (the package index: versions, downloads), :mod:`.download` (fetch and unpack,
locked and resumable; the test-suite's caches use it too)."""
