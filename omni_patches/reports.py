"""What ``status`` and ``doctor`` report: one :class:`~omni_patches.records.PatchStatus` per registry entry.

Reads the engine only through :func:`omni_patches.engine.snapshot` and dry-runs through
:func:`omni_patches.applying.dry_run` (as ``omni-patches audit`` does). Also here: why the shim is not active in a
process; the warnings for a patch whose ``needs`` are not met come from :mod:`omni_patches.needs`.
"""
import os
import sys

from . import engine, flags, needs, registry
from .records import PatchStatus
from .states import State


def _record(spec, state, reason, decision, applied=(), changed=(), cause=None, **extra):
    assumed = {d: v for d, v in decision.installed.items() if d in decision.assumed}
    return PatchStatus(
        id=spec.id, env=flags.env_name(spec.id), state=State(state), reason=reason, summary=spec.summary,
        default=spec.default, enabled=decision.enabled, requires=dict(spec.requires),
        installed=decision.really_installed(), assumed=assumed, targets=tuple(spec.targets),
        applied_targets=tuple(applied), changed=tuple(changed), cause=cause, **extra)


def _inactive(spec, why, would, would_reason, decision, cause=None):
    """``inactive`` record: ``reason`` says both why the shim is off here and what it would do."""
    return _record(spec, State.INACTIVE, f"{why}; with the shim active: {would} ({would_reason})", decision,
                   inactive=why, would=State(would), would_reason=would_reason, cause=cause)


class _NoDecision:
    """Stands in for a gate decision where none could be made (omni-patches' own dependencies are missing)."""

    enabled = True
    installed = assumed = {}
    cause = None

    def really_installed(self):
        return {}


def machinery_problem():
    """Why omni-patches' own dependencies (wrapt, packaging) cannot be imported here, or None."""
    try:
        import packaging.version  # noqa: F401
        import wrapt  # noqa: F401
    except Exception as exc:
        return (f"omni-patches cannot run in this environment: {type(exc).__name__}: {exc} (reinstall it with its "
                "dependencies: pip install omni-patches)")
    return None


def status():
    """One PatchStatus per registry entry, for this process.

    In a process where the shim is not active every patch is ``inactive``: ``inactive`` says why, ``would`` /
    ``would_reason`` what the gates would decide with the shim active (never ``pending`` for a patch that
    cannot apply here).
    """
    from . import gates

    snap = engine.snapshot(check_in_place=True)  # a reloaded target is stock again: never say applied then
    reg = snap.registry if snap.active else registry.load()
    out = []
    why_inactive = None if snap.active else inactive_reason()
    broken = machinery_problem()
    if snap.start_error:
        broken = f"omni-patches could not start in this process ({snap.start_error}): running unpatched"
    for spec in reg.specs.values():
        rt = snap.runs.get(spec.id)
        if rt is not None:
            out.append(_record(spec, rt.state, rt.full_reason(), rt.decision, rt.applied_targets,
                               (r.label for r in rt.records if hasattr(r, "label")), rt.cause))
        elif broken and not snap.active:  # nothing can be gated or applied here: say so, never "pending"
            out.append(_inactive(spec, why_inactive, State.FAILED, broken, _NoDecision()))
        elif broken:
            out.append(_record(spec, State.FAILED, broken, _NoDecision()))
        else:
            decision = gates.decide(spec, master=True if not snap.active or snap.forced else None)
            if not snap.active:
                out.append(_inactive(spec, why_inactive, decision.state, decision.explain(), decision,
                                     decision.cause))
            else:  # active, heavy half not started yet: nothing imported so far
                out.append(_record(spec, decision.state, decision.explain(), decision, cause=decision.cause))
    return needs.with_needs(reg, out)


def doctor():
    """Import every target of every patch that would apply and dry-run its checks; wrap nothing.

    Deactivates the shim in this process first. Returns PatchStatus records; ``state == "ready"`` means the
    patch would apply cleanly.
    """
    from . import applying, gates

    engine.deactivate()
    reg = registry.load()
    broken = machinery_problem()
    if broken:
        return [_record(spec, State.FAILED, broken, _NoDecision()) for spec in reg.specs.values()]
    out = []
    for spec in reg.specs.values():
        decision = gates.decide(spec, master=True)
        result, reason, cause = decision.state, decision.explain(), decision.cause
        if decision.state is State.PENDING:
            run = applying.dry_run(spec, decision, _import_target)
            result, cause = run.state, run.cause
            unimportable = "; ".join(f"{target} ({why})" for target, why in run.absent)
            if result is not State.READY:
                reason = decision.explain(run.reason, run.found)
            elif not run.checked:  # nothing was checked: it cannot be called ready
                result = State.FAILED
                reason = decision.explain("no target could be imported here, so nothing was checked: " +
                                          unimportable, run.found)
            else:
                reason = decision.explain("checks passed for " + ", ".join(run.checked), run.found)
                if unimportable:
                    reason += "; not importable here: " + unimportable
        out.append(_record(spec, result, reason, decision, cause=cause))
    return needs.with_needs(reg, out)


def _import_target(target):
    """``doctor``'s way to load a target for the dry run: import it (an ImportError: not importable here)."""
    import importlib

    from . import applying

    try:
        return importlib.import_module(target)
    except ImportError as exc:  # e.g. an NPU-only module on a GPU host: never imported there
        raise applying.Absent(f"{type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise applying.LoadFailed(f"importing {target} failed: {type(exc).__name__}: {exc}") from exc


def inactive_reason(environ=None):
    """Why the shim is not active in this process (it is not: callers check)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(flags.MASTER)
    value = flags.parse(raw)
    if value is None:
        return f"not active in this process: {flags.MASTER}={flags.shown(raw)} is not an on/off value"
    if not value:
        return f"not active in this process: {flags.MASTER} is {'not set' if raw is None else 'off'}"
    causes = []
    site_dir, path_dir = pth_dirs()
    if sys.flags.no_site:
        causes.append("the interpreter skipped .pth files (python -S)")
    elif site_dir:
        causes.append(f"{flags.MASTER} was not set when this interpreter started (the .pth reads it only then)")
    elif path_dir:
        causes.append(f"omni_patches.pth is in {path_dir}, which is on PYTHONPATH (pip install --target?), and Python "
                      "reads .pth files only in site directories, not on PYTHONPATH: install omni-patches into the "
                      "environment's site-packages, or call site.addsitedir() on that directory")
    else:
        causes.append("omni_patches.pth is not in this interpreter's site-packages")
    plugins = environ.get("VLLM_PLUGINS")
    if plugins is not None and "omni_patches" not in [p.strip() for p in plugins.split(",")]:
        causes.append(f"vLLM's plugin loader skips omni_patches (VLLM_PLUGINS={plugins!r})")
    elif "vllm" in sys.modules:
        causes.append("vLLM's plugin loader has not activated it")
    return (f"not active in this process although {flags.MASTER}={raw}: " + "; ".join(causes) +
            " (call omni_patches.activate(), or start the process with it set)")


def pth_dirs():
    """``(site directory, PYTHONPATH directory)`` holding an ``omni_patches.pth``, each None if none.

    ``site`` reads .pth files in site directories at start-up: site-packages of the venv, of a venv layered on
    it (``site.addsitedir`` from a .pth: on sys.path like any other) and the user site. A directory that is on
    sys.path only through ``PYTHONPATH`` (where ``pip install --target`` users put it) is never read for them.
    """
    import site

    def norm(d):
        return os.path.normcase(os.path.realpath(d))

    has_pth = lambda d: bool(d) and os.path.exists(os.path.join(d, "omni_patches.pth"))  # noqa: E731
    from_env = {norm(d) for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d}
    sites = list(getattr(site, "getsitepackages", lambda: [])())
    if getattr(site, "ENABLE_USER_SITE", False):
        sites.append(getattr(site, "getusersitepackages", lambda: "")())
    site_dir = next((d for d in sites if has_pth(d)), None)
    site_dir = site_dir or next((d for d in sys.path if norm(d or ".") not in from_env and has_pth(d)), None)
    env_dir = next((d for d in sys.path if d and norm(d) in from_env and has_pth(d)), None)
    return site_dir, env_dir


