"""Decide, without importing any target, whether a patch may apply to what is installed."""
import importlib.util
import os

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from . import flags, versions
from .records import ABSENT, APPLIED, DISABLED, FAILED, PENDING, VERSION


def check_spec(spec):
    """Problems ``registry`` cannot see without ``packaging``: bad specifiers and versions. '' when fine."""
    problems = []
    for key in ("requires", "fixed_in"):
        for dist, text in getattr(spec, key).items():
            try:
                SpecifierSet(text) if key == "requires" else Version(text)
            except (InvalidSpecifier, InvalidVersion) as exc:
                problems.append(f"key {key!r}: {dist}: {exc}")
    try:
        found = importlib.util.find_spec(spec.module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        problems.append(f"key 'module': cannot find module {spec.module!r}")
    unknown = set(spec.fixed_in) - set(spec.requires)
    if unknown:
        problems.append(f"key 'fixed_in' names {sorted(unknown)} which 'requires' does not")
    return "; ".join(f"{spec.source}: patch {spec.id!r}: {p}" for p in problems)


def in_range(specifier, version):
    """PEP 440 containment that admits pre-releases inside the range.

    ``packaging`` leaves pre-releases out unless asked (``prereleases=True``), and even then leaves 0.24.0rc1
    out of ``<0.24.0`` (PEP 440's exclusive-ordering rule). Gates are about code, not release channels: an
    rc of 0.24.0 predates 0.24.0, so ``<V`` uses plain version ordering here.
    """
    for s in SpecifierSet(specifier):
        if s.operator == "<":
            if not version < Version(s.version):
                return False
        elif not s.contains(version, prereleases=True):
            return False
    return True


class Decision:
    __slots__ = ("state", "reason", "installed", "enabled")

    def __init__(self, state, reason, installed, enabled):
        self.state, self.reason, self.installed, self.enabled = state, reason, installed, enabled


def decide(spec, *, master=None, environ=os.environ, installed=None):
    """Everything that can be decided before the target is imported.

    Returns a Decision whose state is one of failed / skipped:disabled / skipped:absent / skipped:version,
    or ``pending`` when the patch should be applied once its target is imported.
    ``master=None`` reads OMNI_PATCHES; True/False overrides it (the CLI evaluates "as if on").
    ``installed`` (``{dist: version or None}``) replaces the installed metadata (``omni-patches audit``
    gates on the versions of downloaded wheels); a dist it does not name counts as not installed.
    """
    supplied = installed
    installed = {}
    for dist in spec.requires:
        installed[dist] = supplied.get(dist) if supplied is not None else versions.installed(dist)[1]
    enabled, why = flags.patch_switch(spec.id, spec.default, environ)
    if spec.error:
        return Decision(FAILED, spec.error, installed, enabled)
    problem = check_spec(spec)
    if problem:
        return Decision(FAILED, problem, installed, enabled)
    if master is None:
        master = flags.master_enabled(environ)
    if not master:
        return Decision(DISABLED, f"{flags.MASTER} is off", installed, enabled)
    if not enabled:
        return Decision(DISABLED, why, installed, enabled)
    for dist, specifier in spec.requires.items():
        ver = installed[dist]
        if ver is None:
            return Decision(ABSENT, f"{dist} is not installed", installed, enabled)
        try:
            v = versions.comparable(ver)
        except InvalidVersion:
            return Decision(VERSION, f"{dist} {ver} is not a PEP 440 version", installed, enabled)
        fixed = spec.fixed_in.get(dist)
        if fixed and v >= Version(fixed):
            return Decision(VERSION, f"fixed upstream in {dist} {fixed} (installed {ver})", installed, enabled)
        if not in_range(specifier, v):
            return Decision(VERSION, f"{dist} {ver} is outside {specifier}", installed, enabled)
    targets = ", ".join(spec.targets)
    return Decision(PENDING, f"applies when {targets} is imported", installed, enabled)


__all__ = ["decide", "in_range", "check_spec", "Decision", "APPLIED"]
