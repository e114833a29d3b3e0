"""Tests of ``moe-lora-idle-detach`` (omni_patches/patches/moe_lora_idle_detach.py)."""
