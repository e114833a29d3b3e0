"""Tests of ``lora-cpu-fused-delta`` (omni_patches/patches/lora_cpu_fused_delta.py)."""
