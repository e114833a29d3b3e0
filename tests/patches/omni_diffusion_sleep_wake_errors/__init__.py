"""Tests of ``omni-diffusion-sleep-wake-errors`` (omni_patches/patches/omni_diffusion_sleep_wake_errors.py)."""
