"""Offline tools (never imported by a serving process): ``omni-patches audit`` reads the release files of
upstream versions without installing them -- :mod:`.audit` (verdicts), :mod:`.skeleton` (import a target from
its files alone), :mod:`.index` (the package index: versions, downloads), :mod:`.atomic` (cache entries built
once under a lock, never seen half-built, and safe extraction; the test-suite's caches use it too)."""
