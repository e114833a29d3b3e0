"""Tests of ``ascend-allgather-finalize-order`` (omni_patches/patches/ascend_allgather_finalize_order.py)."""
