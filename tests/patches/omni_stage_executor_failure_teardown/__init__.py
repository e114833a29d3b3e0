"""Tests of ``omni-stage-executor-failure-teardown`` (omni_patches/patches/omni_stage_executor_failure_teardown.py)."""
