"""Activation, lazy application on first import, status and undo.

Start-up path (the .pth line; must cost < 5 ms, stdlib builtins only): :func:`activate` puts a tiny finder
on ``sys.meta_path`` that waits for the first import of a package in :data:`WAKE_ON` (plus the top-level
packages named by ``OMNI_PATCHES_CONFIG`` overlays, which are parsed then). Nothing else happens -- not
even reading the registry -- until one of them is imported.

Then, once: the finder removes itself, the registry is loaded and validated, wrapt/packaging are imported,
every patch is gated on the installed versions and a wrapt post-import hook is registered per target. Each
hook applies its patch to the freshly imported module, isolated: any exception is logged once and the host
import continues unpatched (``OMNI_PATCHES_STRICT=1`` re-raises).
"""
import sys
from _thread import RLock  # not `threading`: its import chain alone would eat the start-up budget

from . import flags, registry

_lock = RLock()

# Top-level packages whose first import wakes the shim. Every target of the built-in registry lives under
# one of them (tests/test_engine.py checks); overlay registries add their own at activation.
WAKE_ON = frozenset(("vllm", "vllm_omni", "vllm_ascend"))


class _Runtime:
    """What happened to one patch in this process."""

    __slots__ = ("state", "reason", "applied_targets", "records", "decision", "found", "notes", "by_target")

    def __init__(self, decision):
        self.decision = decision
        self.state, self.reason = decision.state, decision.reason
        self.applied_targets = []
        self.records = []  # Installed / callback records, in application order
        self.by_target = {}  # target -> the records its application installed (to re-apply after a reload)
        self.found = []  # ctx.describe() texts of the targets checked so far (wrap points, layouts)
        self.notes = {}  # key -> text, set at run time through note() (e.g. a kernel chosen at first use)

    def full_reason(self):
        """The reason plus how the gate decided, what the patch found and noted: what ``status`` shows."""
        return "; ".join([self.decision.explain(self.reason, self.found), *self.notes.values()])


class _State:
    def __init__(self, reg, forced, source):
        self._registry = reg
        self.forced = forced
        self.sources = [source]
        self.started = False  # heavy part done (gates decided, hooks registered)
        self.generation = 0  # bumped by deactivate(): hooks of an older generation do nothing
        self.runtime = {}  # id -> _Runtime
        self.order = []  # every undo record, in the order installed, across patches
        self.trigger = None
        self.ray_prefixes_before = None
        self.start_error = None  # why the heavy half failed ("ModuleNotFoundError: No module named 'wrapt'")

    @property
    def registry(self):
        if self._registry is None:
            self._registry = registry.load()
        return self._registry


_state = None


class _Trigger:
    """``sys.meta_path`` entry that waits for the first import of a watched top-level package."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.names:
            return None
        finder = _start()
        # We are inside the import system's loop over sys.meta_path, which _start() just changed: ask
        # wrapt's finder directly so a hook registered for this very module still fires.
        if finder is not None:
            return finder.find_spec(fullname, path, target)
        return None

    def invalidate_caches(self):  # part of the finder protocol
        pass


def _top_levels(names):
    return {n.partition(".")[0] for n in names}


def activate(*, force=False, source="api"):
    """Turn the shim on for this process. Returns True if this call activated it, False if it was
    already active or the master switch is off. Never raises unless OMNI_PATCHES_STRICT=1."""
    global _state
    try:
        with _lock:
            if _state is not None:
                if source not in _state.sources:
                    _state.sources.append(source)
                return False
            if not force and not flags.master_enabled():
                return False
            _state = state = _State(None, force, source)
            state.ray_prefixes_before = _carry_to_ray_workers()
            watched = set(WAKE_ON) | _overlay_top_levels()
            if any(name in sys.modules for name in watched):
                _start()
            else:
                state.trigger = _Trigger(watched)
                sys.meta_path.insert(0, state.trigger)
            return True
    except Exception as exc:
        if flags.strict():
            raise _strict_error(f"activation failed: {type(exc).__name__}: {exc}", exc)
        from . import log

        log.get().exception("activation failed; running unpatched")
        return False


RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def _carry_to_ray_workers(environ=None):
    """vLLM's Ray executor copies only some variables to its actors; add ours to its extra prefixes.

    Additive: a user's own prefixes stay, and nothing is added if one already covers OMNI_PATCHES.
    """
    import os

    environ = os.environ if environ is None else environ
    before = environ.get(RAY_PREFIXES)
    tokens = [t.strip() for t in (before or "").split(",") if t.strip()]
    if not any("OMNI_PATCHES".startswith(t) for t in tokens):
        environ[RAY_PREFIXES] = ",".join([*tokens, "OMNI_PATCHES"])
    return before


def _restore_ray_prefixes(before):
    import os

    if before is None:
        os.environ.pop(RAY_PREFIXES, None)
    else:
        os.environ[RAY_PREFIXES] = before


def _overlay_top_levels():
    """Top-level packages of overlay targets (parsed only when OMNI_PATCHES_CONFIG is set)."""
    paths = registry.config_paths()[1:]
    if not paths:
        return set()
    reg = registry.load(paths)
    if reg.errors:  # say so now: a broken overlay may mean nothing ever wakes the shim
        _report_registry(reg, check_env=False)  # the built-in ids are not loaded yet
    return _top_levels(t for spec in reg.specs.values() for t in spec.targets)


class StrictModeError(RuntimeError):
    """OMNI_PATCHES_STRICT=1 and something is wrong: raised into the host program's import."""


STRICT_PREFIX = "omni-patches (OMNI_PATCHES_STRICT=1): "


def _strict_error(problem, cause=None):
    """The StrictModeError for ``problem`` (one text naming file / patch / target), chained to ``cause``."""
    if isinstance(cause, StrictModeError):
        return cause
    err = StrictModeError(STRICT_PREFIX + problem)
    err.__cause__ = cause
    return err


class _StrictStop:
    """``sys.meta_path`` entry for a strict-mode problem found before the shim could start (an invalid
    ``OMNI_PATCHES`` value leaves it off): the first import of a watched package raises it into the host
    program, like every other strict-mode problem (a .pth line cannot stop an interpreter)."""

    def __init__(self, names, problem):
        self.names, self.problem = frozenset(names), problem

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.names:
            return None
        problems = [self.problem]
        try:  # every other problem of the environment too, in the same message
            problems += [p for p in environment_problems(registry.load()) if p != self.problem]
        except Exception:  # pragma: no cover - the first problem alone still stops the program
            pass
        raise StrictModeError(STRICT_PREFIX + " | ".join(problems))

    def invalidate_caches(self):  # part of the finder protocol
        pass


def strict_stop(problem):
    """Strict mode, and ``problem`` keeps the shim off: stop the host at its first vLLM-family import (at once
    if one is already imported, e.g. when vLLM's plugin loader calls us)."""
    watched = set(WAKE_ON) | _overlay_top_levels()
    if any(name in sys.modules for name in watched):
        raise StrictModeError(STRICT_PREFIX + problem)
    with _lock:
        if not any(isinstance(f, _StrictStop) for f in sys.meta_path):
            sys.meta_path.insert(0, _StrictStop(watched, problem))


master_problem = flags.master_problem


def environment_problems(reg, environ=None):
    """What is wrong with the ``OMNI_PATCHES*`` variables of ``environ``, as messages (empty when fine)."""
    import os

    from . import log

    environ = os.environ if environ is None else environ
    shown = flags.shown
    problems = []
    raw = environ.get(flags.MASTER)
    if raw is not None and flags.parse(raw) is None:
        problems.append(master_problem(raw))
    for name in ("OMNI_PATCHES_STRICT",):
        if environ.get(name) is not None and flags.parse(environ[name]) is None:
            problems.append(f"{name}={shown(environ[name])} is not an on/off value: treated as off")
    for pid in reg.specs:
        name = flags.env_name(pid)
        if environ.get(name) is not None and flags.parse(environ[name]) is None:
            problems.append(f"{name}={shown(environ[name])} is not an on/off value: {pid} is off")
    for name, close in flags.unknown_names(reg.specs, environ):
        problems.append(f"unknown variable {shown(name)[1:-1] if len(name) > flags.SHOWN else name} ignored" +
                        (f"; did you mean {close}?" if close else ""))
    level = log.level_problem(environ)
    if level:
        problems.append(level)
    kernel = environ.get(KERNEL_VAR)
    if kernel is not None and (kernel or "auto").strip().lower() not in KERNEL_CHOICES:
        # the text lora-cpu-fused-delta logs when it reads the variable: one log line for both
        problems.append(f"{KERNEL_VAR}={shown(kernel)} is not one of {'|'.join(KERNEL_CHOICES)}; using auto")
    state_dir = (environ.get("OMNI_PATCHES_STATE_DIR") or "").strip()
    if state_dir and os.path.exists(state_dir) and not os.path.isdir(state_dir):
        problems.append(f"OMNI_PATCHES_STATE_DIR={shown(state_dir)} is not a directory: no process record is "
                        "written")
    if environ.get("OMNI_PATCHES_ASSUME_VERSION"):
        from . import gates

        assumed, bad = gates.assumed_versions(environ)
        known = {d for spec in reg.specs.values() for d in spec.requires}
        bad = [f"OMNI_PATCHES_ASSUME_VERSION: {b}; ignored" for b in bad]
        bad += [f"OMNI_PATCHES_ASSUME_VERSION names {d}, which no patch gates on; ignored"
                for d in assumed if d not in known]
        problems.extend(bad)
    return problems


# OMNI_PATCHES_LORA_CPU_FUSED_KERNEL (read by lora-cpu-fused-delta at its first load; checked here at start-up so
# that status shows it and strict mode stops on it). tests/test_engine.py keeps these equal to the kernel module's.
KERNEL_VAR = "OMNI_PATCHES_LORA_CPU_FUSED_KERNEL"
KERNEL_CHOICES = ("auto", "addmm", "fp32")


def _report_registry(reg, check_env=True):
    """Log every registry and environment problem once; in strict mode raise them all as one error."""
    from . import log

    for err in reg.errors:
        log.once(40, ("registry", err), "registry problem: %s", err)
    env_problems = environment_problems(reg) if check_env else []
    for problem in env_problems:
        log.once(30, ("env", problem), "%s", problem)
    if check_env and flags.strict():
        from . import gates

        failed = [p for p in (spec.error or gates.check_spec(spec) for spec in reg.specs.values()) if p]
        problems = [*reg.errors, *failed, *env_problems]
        if problems:
            raise StrictModeError(STRICT_PREFIX + " | ".join(problems))


def _start():
    """The heavy half of activation, run once at the first import of a target package."""
    state = _state
    if state is None:
        return None
    with _lock:
        if state.trigger is not None:
            try:
                sys.meta_path.remove(state.trigger)
            except ValueError:
                pass
            state.trigger = None
        if state.started:
            return _wrapt_finder()
        state.started = True
        try:  # instance id here, not in activate(): `OMNI_PATCHES=1 ray start` must not mint one for its node
            from . import proof

            proof.ensure_instance()
        except Exception:  # pragma: no cover - ensure_instance never raises; the import cannot stop the shim
            pass
        try:
            import functools

            import wrapt

            from . import gates, log

            _report_registry(state.registry)
            master = True if state.forced else None
            for spec in state.registry.specs.values():
                decision = gates.decide(spec, master=master)
                rt = state.runtime[spec.id] = _Runtime(decision)
                if decision.state != "pending":
                    level = 40 if decision.state == "failed" else 20
                    log.once(level, ("decision", spec.id), "%s: %s (%s)", spec.id, decision.state, decision.explain())
                    continue
                log.get().debug("%s: waiting for %s", spec.id, ", ".join(spec.targets))
                for target in spec.targets:
                    hook = functools.partial(_on_import, state.generation, spec.id, target)
                    wrapt.register_post_import_hook(hook, target)
                    if rt.state != "pending" and rt.state != "applied":
                        break  # an already-imported target drifted or failed: the rest would be undone anyway
            _log_needs(state)
        except Exception as exc:
            state.start_error = f"{type(exc).__name__}: {exc}"
            if flags.strict():
                raise _strict_error(f"could not start: {state.start_error}", exc)
            from . import log

            log.get().exception("omni-patches could not start; running unpatched")
        from . import proof

        proof.started(state)  # listed by `status --all-processes` even where no patch applies (never raises)
        return _wrapt_finder()


def _wrapt_finder():
    try:
        import wrapt.importer
    except ImportError:  # _start() already logged it; never break the host's import over it
        return None

    for finder in sys.meta_path:
        if isinstance(finder, wrapt.importer.ImportHookFinder):
            return finder
    return None


def _on_import(generation, patch_id, target, module):
    """wrapt post-import hook. Must never raise into the host's import unless strict."""
    try:
        if _state is None or _state.generation != generation:
            return
        _apply_target(_state, patch_id, target, module)
    except Exception as exc:
        if flags.strict():
            raise _strict_error(f"{patch_id}: unexpected error in the import hook for {target}: "
                                f"{type(exc).__name__}: {exc}", exc)
        from . import log

        log.once(40, ("hook", patch_id, target), "%s: unexpected error in the import hook for %s; "
                 "running unpatched", patch_id, target, exc_info=True)


NOT_AFFECTED = "not affected (predates the bug): "


def _apply_target(state, patch_id, target, module, *, dry_run=False):
    import importlib

    from . import log
    from .context import Drift, FixedUpstream, NotAffected, PatchContext

    with _lock:
        rt = state.runtime[patch_id]
        if not dry_run:
            if rt.state not in ("pending", "applied", REVERTED):
                return rt.state
            if target in rt.applied_targets and not _forget_stale(state, rt, target):
                return rt.state  # what it installed is in place: never wrap twice
        spec = state.registry.specs[patch_id]
        sink = []
        ctx = PatchContext(spec, target, module, rt.decision.installed, dry_run=dry_run, sink=sink)
        try:
            impl = importlib.import_module(spec.module)
            check = getattr(impl, "check", None)
            if check is not None:
                check(ctx)
            impl.apply(ctx)
        except FixedUpstream as exc:
            _settle(state, rt, sink, "skipped:version", f"fixed upstream: {exc}", dry_run)
            log.once(20, ("decision", patch_id, "fixed"), "%s: skipped:version (fixed upstream: %s)", patch_id, exc)
            return rt.state
        except NotAffected as exc:  # the code predates the bug (decided by features): a skip, never drift
            _settle(state, rt, sink, "skipped:version", f"{NOT_AFFECTED}{exc}", dry_run)
            log.once(20, ("decision", patch_id, "not-affected"), "%s: skipped:version (%s%s)", patch_id,
                     NOT_AFFECTED, exc)
            return rt.state
        except Drift as exc:
            _settle(state, rt, sink, "drifted", f"{target}: {exc}", dry_run)
            log.once(30, ("decision", patch_id, "drift"), "%s: drifted, not applied (%s: %s)", patch_id, target, exc)
            if flags.strict() and not dry_run:
                raise _strict_error(f"{patch_id}: drifted at {target}: {exc} (nothing applied; "
                                    f"patch module {spec.module})", exc)
            return rt.state
        except Exception as exc:
            _settle(state, rt, sink, "failed", f"{target}: {type(exc).__name__}: {exc}", dry_run)
            log.once(40, ("decision", patch_id, "failed"), "%s: failed, not applied (%s)", patch_id, rt.reason,
                     exc_info=True)
            if flags.strict() and not dry_run:
                raise _strict_error(f"{patch_id}: failed at {target}: {type(exc).__name__}: {exc} (nothing "
                                    f"applied; patch module {spec.module})", exc)
            return rt.state
        rt.found.extend(f for f in ctx.found if f not in rt.found)
        if dry_run:
            return "ready"
        rt.records.extend(sink)
        state.order.extend(sink)
        rt.by_target[target] = list(sink)
        rt.applied_targets.append(target)
        rt.state = "applied"
        rt.reason = "patched " + ", ".join(rt.applied_targets)
        _check_in_place(rt)  # a target reloaded earlier may still be stock
        log.get().info("%s: applied to %s", patch_id, target)
        from . import proof

        proof.applied(state, patch_id)  # per-process record, INFO line, gauge (never raises)
        _log_needs(state)
        return rt.state


REVERTED = "reverted"  # records.REVERTED: applied once, what it installed is no longer in place


def _stale(records):
    """Labels of the records whose installed object is no longer in place (see wrapping.Installed.in_place)."""
    return [r.label for r in records if not getattr(r, "in_place", lambda: True)()]


def _check_in_place(rt):
    """An applied patch whose installed objects are gone -- ``importlib.reload`` of a target re-creates its
    functions and classes, stock -- is ``reverted``, and says which; fine again once re-applied."""
    if rt.state not in ("applied", REVERTED):
        return
    gone = _stale(rt.records)
    if gone:
        rt.state = REVERTED
        rt.reason = (f"applied to {', '.join(rt.applied_targets)}, but no longer in place: {', '.join(gone)} "
                     "(the module was reloaded or the attribute replaced since): stock code runs there")
    elif rt.state == REVERTED:
        rt.state, rt.reason = "applied", "patched " + ", ".join(rt.applied_targets)


def _forget_stale(state, rt, target):
    """The hook fired again for ``target`` (a reloaded module): if what it installed there is gone, undo what
    is left of it and forget it, so that it applies once more (True); False when it is all in place."""
    records = rt.by_target.get(target, [])
    if not _stale(records):
        return False
    for record in reversed(records):
        if getattr(record, "in_place", lambda: False)():
            try:
                record.undo()
            except Exception:  # someone wrapped on top of it: leave that target as it is
                return False
    for record in records:
        if record in state.order:
            state.order.remove(record)
    rt.records = [r for r in rt.records if r not in records]
    rt.by_target.pop(target, None)
    rt.applied_targets = [t for t in rt.applied_targets if t != target]
    return True


def _settle(state, rt, sink, new_state, reason, dry_run):
    """A target could not be patched: undo what this attempt and earlier targets of the patch did."""
    for record in reversed(sink):
        record.undo()
    if dry_run:
        rt.state, rt.reason = new_state, reason
        return
    _undo_records(state, rt)
    rt.state, rt.reason = new_state, reason
    _log_needs(state)


def _undo_records(state, rt):
    problems = []
    for record in reversed(rt.records):
        if getattr(record, "gone", lambda: False)():  # replaced wholesale (a reload): nothing of ours to undo
            state.order.remove(record)
            continue
        try:
            record.undo()
        except Exception as exc:  # someone wrapped on top of us: leave it, report it
            problems.append(str(exc))
            continue
        state.order.remove(record)
    rt.records = [r for r in rt.records if r in state.order]
    if not rt.records:
        rt.applied_targets, rt.by_target = [], {}
    return problems


def unapply(patch_id):
    """Undo one patch. True if something was restored; unknown or never-applied ids give False."""
    from . import log

    with _lock:
        if _state is None or patch_id not in _state.runtime:
            return False
        rt = _state.runtime[patch_id]
        if not rt.records and rt.state != "applied":
            rt.state, rt.reason = ("skipped:disabled", "unapplied at runtime") if rt.state == "pending" else (
                rt.state, rt.reason)
            return False
        problems = _undo_records(_state, rt)
        if problems:
            msg = f"{patch_id}: could not undo everything: " + "; ".join(problems)
            if flags.strict():
                raise StrictModeError(STRICT_PREFIX + msg)
            log.get().error(msg)
            return False
        rt.state, rt.reason = "skipped:disabled", "unapplied at runtime (omni_patches.unapply)"
        log.get().info("%s: unapplied", patch_id)
        return True


def unapply_all():
    """Undo every patch, newest record first. Returns the ids that were undone."""
    with _lock:
        if _state is None:
            return []
        done = []
        for record in reversed(list(_state.order)):
            pid = record.patch_id
            if pid not in done:
                done.append(pid)
        return [pid for pid in done if unapply(pid)]


def deactivate():
    """Undo everything and stop reacting to imports (tests, ``doctor``). Activation may happen again."""
    global _state
    with _lock:
        if _state is None:
            return
        unapply_all()
        if _state.trigger is not None and _state.trigger in sys.meta_path:
            sys.meta_path.remove(_state.trigger)
        _state.generation += 1
        _restore_ray_prefixes(_state.ray_prefixes_before)
        _state = None


def is_active():
    return _state is not None


def note(patch_id, text, key=None):
    """Attach a run-time note to a patch's status (e.g. the kernel a patch chose at first use).

    Shown in the ``status`` reason and in the process record. Cheap, never raises; a note with
    the same ``key`` (default: the patch id) replaces the previous one.
    """
    try:
        with _lock:
            rt = _state.runtime.get(patch_id) if _state is not None else None
            if rt is None:
                return False
            if rt.notes.get(key or patch_id) == str(text):
                return True
            rt.notes[key or patch_id] = str(text)
        from . import proof

        proof.refresh()  # the process record shows it too (a no-op until something applied; never raises)
        return True
    except Exception:  # pragma: no cover - a note must never break the caller
        return False


INACTIVE_SEP = "; with the shim active: "


def inactive_reason(environ=None):
    """Why the shim is not active in this process (it is not: callers check)."""
    import os

    environ = os.environ if environ is None else environ
    raw = environ.get(flags.MASTER)
    value = flags.parse(raw)
    if value is None:
        return f"not active in this process: {flags.MASTER}={flags.shown(raw)} is not an on/off value"
    if not value:
        return f"not active in this process: {flags.MASTER} is {'not set' if raw is None else 'off'}"
    causes = []
    site_dir, path_dir = _pth_dirs()
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


def _pth_dirs():
    """``(site directory, PYTHONPATH directory)`` holding an ``omni_patches.pth``, each None if none.

    ``site`` reads .pth files in site directories at start-up: site-packages of the venv, of a venv layered on
    it (``site.addsitedir`` from a .pth: on sys.path like any other) and the user site. A directory that is on
    sys.path only through ``PYTHONPATH`` (where ``pip install --target`` users put it) is never read for them.
    """
    import os
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


def _pth_installed():
    """Whether an ``omni_patches.pth`` sits in a site directory of this interpreter."""
    return _pth_dirs()[0] is not None


def _record(spec, state, reason, decision, applied=(), changed=()):
    from .records import PatchStatus

    assumed = {d: v for d, v in decision.installed.items() if d in decision.assumed}
    return PatchStatus(
        id=spec.id, env=flags.env_name(spec.id), state=state, reason=reason, summary=spec.summary,
        default=spec.default, enabled=decision.enabled, requires=dict(spec.requires),
        installed=decision.really_installed(), assumed=assumed, targets=tuple(spec.targets),
        applied_targets=tuple(applied), changed=tuple(changed))


class _NoDecision:
    """Stands in for a gate decision where none could be made (omni-patches' own dependencies are missing)."""

    enabled = True
    installed = assumed = {}

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


_NEEDED_OK = ("applied", "pending", "ready", "skipped:absent")


def _needed_problem(rec):
    """Why ``rec`` (a patch another one needs) leaves that one incorrect here, or None."""
    if rec.state in _NEEDED_OK or (rec.state == "skipped:version" and ("fixed upstream" in rec.reason or
                                                                        NOT_AFFECTED in rec.reason)):
        return None
    return f"{rec.state} ({rec.reason})"


def _with_needs(reg, records):
    """Warn on each applied/pending/ready patch whose ``needs`` are off, drifted or out of range here."""
    import dataclasses

    by_id = {r.id: r for r in records}
    out = []
    for rec in records:
        spec = reg.specs.get(rec.id)
        warnings = []
        if spec is not None and rec.state in ("applied", "pending", "ready"):
            for other in spec.needs:
                why = _needed_problem(by_id[other]) if other in by_id else "not in the registry"
                if why:
                    warnings.append(f"needs {other} on this stack, which is {why}: {rec.id} alone is not correct here")
        if warnings:
            rec = dataclasses.replace(rec, warnings=tuple(warnings),
                                      reason=rec.reason + "; WARNING: " + "; ".join(warnings))
        out.append(rec)
    return out


def _log_needs(state):
    """Log once when an applied patch's needed patch ended disabled, drifted, failed or out of range."""
    from . import log

    for spec in state.registry.specs.values():
        rt = state.runtime.get(spec.id)
        if rt is None or rt.state != "applied":
            continue
        for other in spec.needs:
            ort = state.runtime.get(other)
            if ort is None:
                continue
            why = _needed_problem(_record(state.registry.specs[other], ort.state, ort.full_reason(), ort.decision))
            if why:
                log.once(30, ("needs", spec.id, other, ort.state), "%s: applied, but it needs %s on this stack, "
                         "which is %s: the result is not correct here", spec.id, other, why)


def status():
    """One PatchStatus per registry entry, for this process.

    In a process where the shim is not active every patch is ``inactive``: the reason says why, and what the
    gates would decide with the shim active (never ``pending`` for a patch that cannot apply here).
    """
    with _lock:
        reg = _state.registry if _state is not None else registry.load()
        out = []
        why_inactive = inactive_reason() if _state is None else None
        broken = machinery_problem()
        if _state is not None and _state.start_error:
            broken = f"omni-patches could not start in this process ({_state.start_error}): running unpatched"
        for spec in reg.specs.values():
            rt = _state.runtime.get(spec.id) if _state is not None else None
            if rt is not None:
                _check_in_place(rt)  # a reloaded target is stock again: never say applied then
                out.append(_record(spec, rt.state, rt.full_reason(), rt.decision, rt.applied_targets,
                                   (r.label for r in rt.records if hasattr(r, "label"))))
                continue
            if broken:  # nothing can be gated or applied here: say so, never "pending"
                out.append(_record(spec, "inactive" if _state is None else "failed",
                                   f"{why_inactive}{INACTIVE_SEP}failed ({broken})" if _state is None else broken,
                                   _NoDecision()))
                continue
            from . import gates

            decision = gates.decide(spec, master=True if _state is None or _state.forced else None)
            if _state is None:
                out.append(_record(spec, "inactive", f"{why_inactive}{INACTIVE_SEP}{decision.state} "
                                   f"({decision.explain()})", decision))
            else:  # active, heavy half not started yet: nothing imported so far
                out.append(_record(spec, decision.state, decision.explain(), decision))
        return _with_needs(reg, out)


def registry_errors():
    with _lock:
        reg = _state.registry if _state is not None else registry.load()
        return list(reg.errors)


def doctor():
    """Import every target of every patch that would apply and dry-run its checks; wrap nothing.

    Returns PatchStatus records; ``state == "ready"`` means the patch would apply cleanly.
    """
    import importlib

    deactivate()
    reg = registry.load()
    broken = machinery_problem()
    if broken:
        return [_record(spec, "failed", broken, _NoDecision()) for spec in reg.specs.values()]
    from . import gates

    state = _State(reg, True, "doctor")
    out = []
    for spec in reg.specs.values():
        decision = gates.decide(spec, master=True)
        rt = state.runtime[spec.id] = _Runtime(decision)
        result, reason = decision.state, decision.explain()
        if decision.state == "pending":
            checked, unimportable = [], []
            result = "ready"
            for target in spec.targets:
                try:
                    module = importlib.import_module(target)
                except ImportError as exc:  # e.g. an NPU-only module on a GPU host: never imported there
                    unimportable.append(f"{target} ({type(exc).__name__}: {exc})")
                    continue
                except Exception as exc:
                    result, reason = "failed", f"importing {target} failed: {type(exc).__name__}: {exc}"
                    break
                checked.append(target)
                got = _apply_target(state, spec.id, target, module, dry_run=True)
                if got != "ready":
                    result, reason = got, rt.full_reason()
                    break
            if result == "ready" and not checked:  # nothing was checked: it cannot be called ready
                result = "failed"
                reason = decision.explain("no target could be imported here, so nothing was checked: " +
                                          "; ".join(unimportable), rt.found)
            elif result == "ready":
                reason = decision.explain("checks passed for " + ", ".join(checked), rt.found)
                if unimportable:
                    reason += "; not importable here: " + "; ".join(unimportable)
        out.append(_record(spec, result, reason, decision))
    return _with_needs(reg, out)
