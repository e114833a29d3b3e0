"""The lifecycle: activation, lazy application on first import, undo -- and the one public view of it.

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

# ``states`` (an enum: ~7 ms of imports) is imported inside the functions that run after start-up, never here.

_lock = RLock()

# Top-level packages whose first import wakes the shim. Every target of the built-in registry lives under
# one of them (tests/test_engine.py checks); overlay registries add their own at activation.
WAKE_ON = frozenset(("vllm", "vllm_omni", "vllm_ascend"))


class _State:
    def __init__(self, reg, forced, source):
        self._registry = reg
        self.forced = forced
        self.sources = [source]
        self.started = False  # heavy part done (gates decided, hooks registered)
        self.generation = 0  # bumped by deactivate(): hooks of an older generation do nothing
        self.runtime = {}  # id -> runs.PatchRun
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
            state.ray_prefixes_before = carry_to_ray_workers()
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


def carry_to_ray_workers(environ=None):
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
            from . import envcheck

            problems += [p for p in envcheck.environment_problems(registry.load()) if p != self.problem]
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


def _report_registry(reg, check_env=True):
    """Log every registry and environment problem once; in strict mode raise them all as one error."""
    from . import envcheck, log

    for err in reg.errors:
        log.once(40, ("registry", err), "registry problem: %s", err)
    env_problems = envcheck.environment_problems(reg) if check_env else []
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
    from .states import State

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
            from .runs import PatchRun

            _report_registry(state.registry)
            master = True if state.forced else None
            for spec in state.registry.specs.values():
                decision = gates.decide(spec, master=master)
                rt = state.runtime[spec.id] = PatchRun(spec.id, decision)
                if decision.state != State.PENDING:
                    level = 40 if decision.state == State.FAILED else 20
                    log.once(level, ("decision", spec.id), "%s: %s (%s)", spec.id, decision.state, decision.explain())
                    continue
                log.get().debug("%s: waiting for %s", spec.id, ", ".join(spec.targets))
                for target in spec.targets:
                    hook = functools.partial(_on_import, state.generation, spec.id, target)
                    wrapt.register_post_import_hook(hook, target)
                    if rt.state not in (State.PENDING, State.APPLIED):
                        break  # an already-imported target drifted or failed: the rest would be undone anyway
            _log_needs(state)
        except Exception as exc:
            state.start_error = f"{type(exc).__name__}: {exc}"
            if flags.strict():
                raise _strict_error(f"could not start: {state.start_error}", exc)
            from . import log

            log.get().exception("omni-patches could not start; running unpatched")
        from . import proof

        proof.started()  # listed by `status --all-processes` even where no patch applies (never raises)
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


def _attempt(spec, target, module, rt, dry_run):
    """Run the patch's ``check`` and ``apply`` on ``module``. Returns ``(sink, None)`` when it went through, else
    ``(sink, (state, reason, cause, exc))`` -- what was installed before it stopped is in ``sink``."""
    import importlib

    from .context import Drift, FixedUpstream, NotAffected, PatchContext
    from .states import Cause, State

    sink = []
    ctx = PatchContext(spec, target, module, rt.decision.installed, rt, dry_run=dry_run, sink=sink)
    try:
        impl = importlib.import_module(spec.module)
        check = getattr(impl, "check", None)
        if check is not None:
            check(ctx)
        impl.apply(ctx)
    except FixedUpstream as exc:
        return sink, (State.VERSION, f"fixed upstream: {exc}", Cause.FIXED_UPSTREAM, exc)
    except NotAffected as exc:  # the code predates the bug (decided by features): a skip, never drift
        return sink, (State.VERSION, f"{Cause.NOT_AFFECTED}: {exc}", Cause.NOT_AFFECTED, exc)
    except Drift as exc:
        return sink, (State.DRIFTED, f"{target}: {exc}", None, exc)
    except Exception as exc:
        return sink, (State.FAILED, f"{target}: {type(exc).__name__}: {exc}", None, exc)
    rt.found.extend(f for f in ctx.found if f not in rt.found)
    return sink, None


def check_target(spec, decision, target, module):
    """Dry-run ``spec``'s checks on an imported ``module`` (``doctor``, ``omni-patches audit``): nothing is
    wrapped, nothing logged, the engine's own records untouched. Returns a fresh :class:`~omni_patches.runs.
    PatchRun` whose state is ``ready`` when the patch would apply there, else drifted / failed / skipped:version
    with its reason and cause; ``found`` lists what the patch recognised."""
    from .runs import PatchRun
    from .states import State

    rt = PatchRun(spec.id, decision)
    _, outcome = _attempt(spec, target, module, rt, dry_run=True)  # a dry run installs nothing
    if outcome is None:
        rt.set(State.READY, "")
    else:
        rt.set(*outcome[:3])
    return rt


def _apply_target(state, patch_id, target, module):
    from . import log
    from .states import State

    with _lock:
        rt = state.runtime[patch_id]
        if rt.state not in (State.PENDING, State.APPLIED, State.REVERTED):
            return rt.state
        if target in rt.applied_targets and not _forget_stale(state, rt, target):
            return rt.state  # what it installed is in place: never wrap twice
        spec = state.registry.specs[patch_id]
        sink, outcome = _attempt(spec, target, module, rt, dry_run=False)
        if outcome is not None:
            new_state, reason, cause, exc = outcome
            for record in reversed(sink):  # what this attempt installed, then what earlier targets did
                record.undo()
            _undo_records(state, rt)
            rt.set(new_state, reason, cause)
            _log_needs(state)
            _report_outcome(spec, target, rt, exc)
            return rt.state
        rt.records.extend(sink)
        state.order.extend(sink)
        rt.by_target[target] = list(sink)
        rt.applied_targets.append(target)
        rt.set(State.APPLIED, "patched " + ", ".join(rt.applied_targets))
        _check_in_place(rt)  # a target reloaded earlier may still be stock
        log.get().info("%s: applied to %s", patch_id, target)
        from . import proof

        proof.applied(patch_id)  # per-process record, INFO line, gauge (never raises)
        _log_needs(state)
        return rt.state


def _report_outcome(spec, target, rt, exc):
    """Log why ``spec`` did not apply at ``target`` (once); strict mode turns drift and failure into errors."""
    from . import log
    from .states import Cause, State

    pid = spec.id
    if rt.cause in (Cause.FIXED_UPSTREAM, Cause.NOT_AFFECTED):
        key = "fixed" if rt.cause is Cause.FIXED_UPSTREAM else "not-affected"
        log.once(20, ("decision", pid, key), "%s: %s (%s)", pid, rt.state, rt.reason)
        return
    if rt.state is State.DRIFTED:
        log.once(30, ("decision", pid, "drift"), "%s: drifted, not applied (%s: %s)", pid, target, exc)
        if flags.strict():
            raise _strict_error(f"{pid}: drifted at {target}: {exc} (nothing applied; patch module {spec.module})", exc)
        return
    log.once(40, ("decision", pid, "failed"), "%s: failed, not applied (%s)", pid, rt.reason, exc_info=exc)
    if flags.strict():
        raise _strict_error(f"{pid}: failed at {target}: {type(exc).__name__}: {exc} (nothing applied; patch "
                            f"module {spec.module})", exc)


def _stale(records):
    """Labels of the records whose installed object is no longer in place (see wrapping.Installed.in_place)."""
    return [r.label for r in records if not getattr(r, "in_place", lambda: True)()]


def _check_in_place(rt):
    """An applied patch whose installed objects are gone -- ``importlib.reload`` of a target re-creates its
    functions and classes, stock -- is ``reverted``, and says which; fine again once re-applied."""
    from .states import State

    if rt.state not in (State.APPLIED, State.REVERTED):
        return
    gone = _stale(rt.records)
    if gone:
        rt.set(State.REVERTED, f"applied to {', '.join(rt.applied_targets)}, but no longer in place: "
               f"{', '.join(gone)} (the module was reloaded or the attribute replaced since): stock code runs there")
    elif rt.state is State.REVERTED:
        rt.set(State.APPLIED, "patched " + ", ".join(rt.applied_targets))


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
    from .states import Cause, State

    with _lock:
        if _state is None or patch_id not in _state.runtime:
            return False
        rt = _state.runtime[patch_id]
        if not rt.records and rt.state is not State.APPLIED:
            if rt.state is State.PENDING:
                rt.set(State.DISABLED, "unapplied at runtime", Cause.UNAPPLIED)
            return False
        problems = _undo_records(_state, rt)
        if problems:
            msg = f"{patch_id}: could not undo everything: " + "; ".join(problems)
            if flags.strict():
                raise StrictModeError(STRICT_PREFIX + msg)
            log.get().error(msg)
            return False
        rt.set(State.DISABLED, "unapplied at runtime (omni_patches.unapply)", Cause.UNAPPLIED)
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


def reapply(module):
    """Apply again to ``module`` what was applied there -- e.g. after ``importlib.reload``, which leaves stock
    code behind (``status`` says ``reverted``). Every patch that targets it, or that changed it from one of its
    targets (a helper module the target calls), as its import hook does: never wrapping twice, a patch in any
    other state untouched. Returns ``{patch id: state}`` for those patches."""
    state = _state
    name = getattr(module, "__name__", None)
    if state is None or not state.started:
        return {}
    out = {}
    for pid, rt in list(state.runtime.items()):
        if name in state.registry.specs[pid].targets:
            _on_import(state.generation, pid, name, module)
        elif any(_module_of(getattr(r, "owner", None)) == name for r in rt.records):
            for target in list(rt.applied_targets):
                if sys.modules.get(target) is not None:
                    _on_import(state.generation, pid, target, sys.modules[target])
        else:
            continue
        out[pid] = rt.state
    return out


def _module_of(owner):
    return getattr(owner, "__name__", None) if isinstance(owner, type(sys)) else getattr(owner, "__module__", None)


class Snapshot:
    """What the engine holds in this process, for readers (status, doctor, the process record, tests).

    ``active``: the shim is on here; ``registry``: the registry it runs (None when not active); ``forced``:
    activated with ``force=True``; ``sources``: who called ``activate`` (in order); ``started``: the heavy half ran (gates decided); ``start_error``: why that
    failed; ``runs``: ``{patch id: PatchRun}`` (the live records: read, never change them).
    """

    __slots__ = ("active", "registry", "forced", "sources", "started", "start_error", "runs")

    def __init__(self, state):
        self.active = state is not None
        self.sources = list(state.sources) if state is not None else []  # who activated it: pth, vllm-plugin, api
        self.registry = state.registry if state is not None else None
        self.forced = bool(state and state.forced)
        self.started = bool(state and state.started)
        self.start_error = state.start_error if state is not None else None
        self.runs = dict(state.runtime) if state is not None else {}


def snapshot(*, check_in_place=False):
    """The engine's current :class:`Snapshot`. Takes no lock (a forked child may not get one) unless
    ``check_in_place``: then every applied patch is first checked still in place (a reloaded target is stock
    again: never say applied then)."""
    state = _state
    if check_in_place and state is not None:
        with _lock:
            for rt in state.runtime.values():
                _check_in_place(rt)
    return Snapshot(state)


def run(patch_id):
    """``patch_id``'s :class:`~omni_patches.runs.PatchRun` in this activation, or None (inactive, not started,
    unknown id)."""
    state = _state
    return state.runtime.get(patch_id) if state is not None else None


def _log_needs(state):
    """Log once when an applied patch's needed patch ended disabled, drifted, failed or out of range."""
    from . import log, reports
    from .states import State

    for spec in state.registry.specs.values():
        rt = state.runtime.get(spec.id)
        if rt is None or rt.state is not State.APPLIED:
            continue
        for other in spec.needs:
            ort = state.runtime.get(other)
            if ort is None:
                continue
            why = reports.needed_problem(ort.state, ort.cause, ort.full_reason())
            if why:
                log.once(30, ("needs", spec.id, other, str(ort.state)), "%s: applied, but it needs %s on this stack, "
                         "which is %s: the result is not correct here", spec.id, other, why)


def registry_errors():
    with _lock:
        reg = _state.registry if _state is not None else registry.load()
        return list(reg.errors)
