"""Patch modules used only by the engine tests (registered through OMNI_PATCHES_CONFIG overlays)."""
