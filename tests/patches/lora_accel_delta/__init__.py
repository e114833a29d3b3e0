"""Tests of ``lora-accel-delta`` (omni_patches/patches/lora_accel_delta.py)."""
