"""Tests of ``moe-ep-parallel-mapping`` (omni_patches/patches/moe_ep_parallel_mapping.py)."""
