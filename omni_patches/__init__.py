"""omni-patches: runtime fixes for vllm / vllm-omni / vllm-ascend, applied when a target is first imported.

Public API (all lazy: importing this package costs nothing measurable)::

    omni_patches.activate()        # what the .pth line does when OMNI_PATCHES=1
    omni_patches.status()          # list[PatchStatus], one per registry entry
    omni_patches.unapply("id")     # restore the originals of one patch
    omni_patches.unapply_all()     # restore everything, newest first
"""

from ._version import __version__  # noqa: F401  (its own module: the process record reads it without this front)


def activate(*, force: bool = False, source: str = "api"):
    """Activate the shim in this process. Idempotent. ``force`` ignores the OMNI_PATCHES master switch."""
    from .engine import activate as _activate

    return _activate(force=force, source=source)


def status():
    """Return one :class:`omni_patches.records.PatchStatus` per registry entry."""
    from .reports import status as _status

    return _status()


def unapply(patch_id: str) -> bool:
    """Restore every attribute the patch replaced. Returns False if it was not applied."""
    from .engine import unapply as _unapply

    return _unapply(patch_id)


def unapply_all() -> list:
    """Restore every patch, newest first. Returns the ids that were undone."""
    from .engine import unapply_all as _unapply_all

    return _unapply_all()
