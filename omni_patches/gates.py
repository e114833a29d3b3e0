"""Decide, without importing any target, whether a patch may apply to what is installed."""
import importlib.util
import os
import re

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from . import flags, prose, versions
from .states import Cause, State


def check_spec(spec):
    """Problems ``registry`` cannot see without ``packaging`` or the module's source: bad specifiers and versions,
    a module that cannot be found, prose missing or given twice (:func:`omni_patches.prose.problem`). '' when
    fine."""
    problems = []  # (keys, text): each problem names the file that set its key (an overlay, not the shipped file)
    for key in ("requires", "fixed_in"):
        for dist, text in getattr(spec, key).items():
            try:
                SpecifierSet(text) if key == "requires" else Version(text)
            except (InvalidSpecifier, InvalidVersion) as exc:
                problems.append(((key,), f"key {key!r}: {dist}: {exc}"))
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        problems.append((("module",), f"key 'module': cannot find module {spec.module!r}"))
    else:  # its prose: the record opening the module's source (first bytes only), or an overlay's table
        problems.append(prose.problem(spec, found))
    unknown = set(spec.fixed_in) - set(spec.requires)
    if unknown:
        problems.append((("fixed_in", "requires"), f"key 'fixed_in' names {sorted(unknown)} which 'requires' does not"))
    return "; ".join(f"{spec.where(*keys)}: patch {spec.id!r}: {p}" for keys, p in filter(None, problems))


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


ASSUME = "OMNI_PATCHES_ASSUME_VERSION"


class Decision:
    """What the gate decided. ``by_features``: "dist X is a source build" texts (the version was not used);
    ``notes``: other facts worth showing (an assumed version)."""

    __slots__ = ("state", "reason", "cause", "installed", "enabled", "by_features", "notes", "assumed")

    def __init__(self, state, reason, installed, enabled, by_features=(), notes=(), assumed=None, cause=None):
        # installed: the versions the gate used (an assumed one in place of the installed one);
        # assumed: {dist: version really installed} for each dist whose version was assumed.
        self.state, self.reason, self.installed, self.enabled = state, reason, installed, enabled
        self.cause = cause
        self.by_features, self.notes = list(by_features), list(notes)
        self.assumed = dict(assumed or {})

    def really_installed(self):
        """The installed versions, assumed ones replaced by what is really installed."""
        return {d: self.assumed.get(d, v) for d, v in self.installed.items()}

    def explain(self, reason=None, found=()):
        """``reason`` (default the gate's) with the source-build verdict and the notes: what status shows."""
        parts = [self.reason if reason is None else reason]
        found = "; ".join(found)
        if self.by_features:
            parts.append(", ".join(self.by_features) + ": decided by code features" + (f" ({found})" if found else ""))
        elif found:
            parts.append("found: " + found)
        parts.extend(self.notes)
        return "; ".join(p for p in parts if p)


def assumed_versions(environ=os.environ):
    """``OMNI_PATCHES_ASSUME_VERSION`` parsed: ``({dist: version}, [problem, ...])``."""
    return versions.parse_assumed(environ.get(ASSUME))


def decide(spec, *, master=None, environ=os.environ, installed=None, seen="installed"):
    """Everything that can be decided before the target is imported.

    Returns a Decision whose state is one of failed / skipped:disabled / skipped:absent / skipped:version,
    or ``pending`` when the patch should be applied once its target is imported.
    ``master=None`` reads OMNI_PATCHES; True/False overrides it (the CLI evaluates "as if on").
    ``installed`` (``{dist: version or None}``) replaces the installed metadata (``omni-patches audit``
    gates on the versions of downloaded wheels); a dist it does not name counts as not installed. ``seen``:
    the word a reason uses for where a version was read ("fixed upstream in X 0.31.0 (audited 0.32.0)").

    Versions: ``OMNI_PATCHES_ASSUME_VERSION`` replaces the version of an installed distribution. A source
    build's version (:func:`omni_patches.versions.source_build`) says nothing about its code, so unless the
    patch declares ``source_builds = "version"`` its range and ``fixed_in`` are not checked: the patch's own
    feature checks decide when the target is imported (drifted / fixed upstream / applied).
    """
    supplied = installed
    installed, notes, really = {}, [], {}
    assumed, _ = assumed_versions(environ)
    for dist in spec.requires:
        have = supplied.get(dist) if supplied is not None else versions.installed(dist)[1]
        want = assumed.get(re.sub(r"[-_.]+", "-", dist).lower())
        if want is not None and have is not None and want != have:
            notes.append(f"{dist} {want} assumed ({ASSUME}; installed {have})")
            really[dist] = have
            have = want
        installed[dist] = have
    enabled, why = flags.patch_switch(spec.id, spec.default, environ)

    def out(state, reason, by_features=(), cause=None):
        return Decision(state, reason, installed, enabled, by_features, notes, really, cause)

    if spec.error:
        return out(State.FAILED, spec.error)
    problem = check_spec(spec)
    if problem:
        return out(State.FAILED, problem)
    if master is None:
        master = flags.master_enabled(environ)
    if not master:
        return out(State.DISABLED, f"{flags.MASTER} is off", cause=Cause.MASTER_OFF)
    if not enabled:
        return out(State.DISABLED, why, cause=Cause.SWITCHED_OFF)
    by_features = []
    for dist, specifier in spec.requires.items():
        ver = installed[dist]
        if ver is None:
            return out(State.ABSENT, f"{dist} is not installed", cause=Cause.NOT_INSTALLED)
        untrusted = versions.source_build(ver)
        if untrusted and spec.source_builds == "features":
            by_features.append(f"{dist} {ver} {untrusted}")
            continue
        hint = (f" ({untrusted}; this patch keeps the version rule: set {ASSUME}={dist}=<release its code "
                f"matches> to decide)") if untrusted else ""
        try:
            v = versions.comparable(ver)
        except InvalidVersion:
            return out(State.VERSION, f"{dist} {ver} is not a PEP 440 version{hint}", cause=Cause.BAD_VERSION)
        fixed = spec.fixed_in.get(dist)
        if fixed and v >= Version(fixed):
            return out(State.VERSION, f"fixed upstream in {dist} {fixed} ({seen} {ver}){hint}",
                       cause=Cause.FIXED_UPSTREAM)
        if not in_range(specifier, v):
            return out(State.VERSION, f"{dist} {ver} is outside {specifier}{hint}", cause=Cause.OUT_OF_RANGE)
    targets = ", ".join(spec.targets)
    return out(State.PENDING, f"applies when {targets} is imported", by_features)


__all__ = ["decide", "in_range", "check_spec", "Decision"]
