"""The :class:`PatchStatus` that :func:`omni_patches.status` returns and the CLI prints (its state and cause
are the typed words of :mod:`omni_patches.states`)."""
from dataclasses import asdict, dataclass, field

from .states import Cause, State


@dataclass(frozen=True)
class PatchStatus:
    id: str
    env: str
    state: State
    reason: str
    summary: str = ""
    default: bool = True
    enabled: bool = True
    requires: dict = field(default_factory=dict)  # distribution -> PEP 440 specifier
    installed: dict = field(default_factory=dict)  # distribution -> installed version or None
    assumed: dict = field(default_factory=dict)  # distribution -> version gated on instead (OMNI_PATCHES_ASSUME_VERSION)
    targets: tuple = ()
    applied_targets: tuple = ()
    changed: tuple = ()  # "module.Class.attr" of every attribute the patch replaced in this process
    warnings: tuple = ()  # e.g. a patch this one needs is off or drifted here (doctor exits 1)
    cause: Cause = None  # why it is skipped (skipped:* states), else None
    inactive: str = ""  # state inactive: why the shim is off in this process (``reason`` = both parts)
    would: State = None  # state inactive: what it would be with the shim active, and why (would_reason)
    would_reason: str = ""

    def to_dict(self):
        d = asdict(self)
        for key in ("targets", "applied_targets", "changed", "warnings"):
            d[key] = list(d[key])
        for key in ("state", "cause", "would"):
            d[key] = None if d[key] is None else str(d[key])
        return d
