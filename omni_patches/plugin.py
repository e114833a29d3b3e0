"""vLLM ``vllm.general_plugins`` entry point.

vLLM loads general plugins in every process it starts (engine core, each worker before its class is
built), so this reaches processes whose interpreter skipped the .pth (``python -S``, embedded
interpreters, site-packages without .pth processing). Same rules as the .pth: OMNI_PATCHES decides, and
activation twice (.pth and plugin) wraps once. ``VLLM_PLUGINS`` can leave it out by name (``omni_patches``).
"""


def register():
    from ._bootstrap import pth_hook

    pth_hook(source="vllm-plugin")
    import os

    if os.environ.get("OMNI_PATCHES_INSTANCE"):  # a process of an instance whose driver ran the shim: if the
        from . import proof                      # shim stays off here, `status --all-processes` lists it as such

        proof.inactive_here(_why_inactive)


def _why_inactive():
    """Why the shim is off in this process, or None when it is on (the process record's own entry then)."""
    from . import engine, reports

    return None if engine.is_active() else reports.inactive_reason()
