"""Typed status records returned by :func:`omni_patches.status` and printed by the CLI."""
from dataclasses import asdict, dataclass, field

APPLIED = "applied"
PENDING = "pending"
DISABLED = "skipped:disabled"
VERSION = "skipped:version"
ABSENT = "skipped:absent"
DRIFTED = "drifted"
FAILED = "failed"
INACTIVE = "inactive"  # the shim is not active in this process; the reason says why and what it would do
REVERTED = "reverted"  # applied, but what it installed is no longer in place (its module reloaded): stock runs
STATES = (APPLIED, PENDING, DISABLED, VERSION, ABSENT, DRIFTED, FAILED, INACTIVE, REVERTED)


@dataclass(frozen=True)
class PatchStatus:
    id: str
    env: str
    state: str
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

    def to_dict(self):
        d = asdict(self)
        for key in ("targets", "applied_targets", "changed", "warnings"):
            d[key] = list(d[key])
        return d
