"""Tests of ``ascend-execute-model-timeout`` (omni_patches/patches/ascend_execute_model_timeout.py)."""
