"""Tests of ``vllm-moe-lora-stale-token-ids`` (omni_patches/patches/vllm_moe_lora_stale_token_ids.py)."""
