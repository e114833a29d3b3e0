"""Tests of ``ascend-moe-skip-idle-lora`` (omni_patches/patches/ascend_moe_skip_idle_lora.py)."""
