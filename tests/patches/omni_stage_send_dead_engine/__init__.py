"""Tests of ``omni-stage-send-dead-engine`` (omni_patches/patches/omni_stage_send_dead_engine.py)."""
