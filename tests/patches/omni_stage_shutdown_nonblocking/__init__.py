"""Tests of ``omni-stage-shutdown-nonblocking`` (omni_patches/patches/omni_stage_shutdown_nonblocking.py)."""
