"""Typed status records returned by :func:`omni_patches.status` and printed by the CLI."""
from dataclasses import asdict, dataclass, field

APPLIED = "applied"
PENDING = "pending"
DISABLED = "skipped:disabled"
VERSION = "skipped:version"
ABSENT = "skipped:absent"
DRIFTED = "drifted"
FAILED = "failed"
STATES = (APPLIED, PENDING, DISABLED, VERSION, ABSENT, DRIFTED, FAILED)


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
    targets: tuple = ()
    applied_targets: tuple = ()

    def to_dict(self):
        d = asdict(self)
        d["targets"], d["applied_targets"] = list(self.targets), list(self.applied_targets)
        return d
