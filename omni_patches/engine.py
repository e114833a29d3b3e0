"""The lifecycle: activation, lazy application on first import, undo -- and the one public view of it.

Start-up path (the .pth line; must cost < 5 ms, stdlib builtins only): :func:`activate` puts a tiny finder
on ``sys.meta_path`` that waits for the first import of a package in :data:`WAKE_ON` (plus the top-level
packages named by ``OMNI_PATCHES_CONFIG`` overlays, which are parsed then). Nothing else happens -- not
even reading the registry -- until one of them is imported.

Then, once: the finder removes itself and :mod:`.starting` does the heavy half (registry checked, wrapt and
packaging imported, every patch gated, a wrapt post-import hook registered per target). Each hook applies its
patch to the freshly imported module (:mod:`.applying`), isolated: any exception is logged once and the host
import continues unpatched (``OMNI_PATCHES_STRICT=1`` re-raises, :mod:`.strict`). :mod:`.undo` and
:mod:`.staleness` undo and re-check what was installed.

This module holds the process's one activation state and passes it down to those modules; none of them imports
this one.
"""
import sys
from _thread import RLock  # not `threading`: its import chain alone would eat the start-up budget

from . import flags, registry

# ``states`` (an enum: ~7 ms of imports) and everything below the start-up path are imported inside the functions
# that run after start-up, never here.

_lock = RLock()

# Top-level packages whose first import wakes the shim. Every target of the built-in registry lives under
# one of them (tests/test_engine.py checks); overlay registries add their own at activation.
WAKE_ON = frozenset(("vllm", "vllm_omni", "vllm_ascend"))


class _State:
    """One activation: what the modules below the engine are handed (they never read this module's globals)."""

    lock = _lock  # every change to an activation's records takes it (reentrant: unapply_all calls unapply)

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
            from . import strict

            raise strict.error(f"activation failed: {type(exc).__name__}: {exc}", exc)
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
        from . import strict

        strict.report_registry(reg, check_env=False)  # the built-in ids are not loaded yet
    return _top_levels(t for spec in reg.specs.values() for t in spec.targets)


def __getattr__(name):
    """``engine.StrictModeError``: its public name (docs, the traceback line), defined in :mod:`.strict` and
    imported only when asked for (never at interpreter start)."""
    if name == "StrictModeError":
        from .strict import StrictModeError

        return StrictModeError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def strict_stop(problem):
    """Strict mode, and ``problem`` keeps the shim off: stop the host at its first vLLM-family import (at once
    if one is already imported, e.g. when vLLM's plugin loader calls us)."""
    from . import strict

    watched = set(WAKE_ON) | _overlay_top_levels()
    if any(name in sys.modules for name in watched):
        raise strict.StrictModeError(strict.PREFIX + problem)
    with _lock:
        if not any(isinstance(f, strict.Stop) for f in sys.meta_path):
            sys.meta_path.insert(0, strict.Stop(watched, problem))


def _start():
    """The heavy half of activation (:func:`omni_patches.starting.start`), run once at the first import of a
    target package; returns wrapt's import finder."""
    from . import starting

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
            return starting.wrapt_finder()
        state.started = True
        return starting.start(state)


def unapply(patch_id):
    """Undo one patch. True if something was restored; unknown or never-applied ids give False."""
    from . import undo

    with _lock:
        if _state is None:
            return False
        return undo.unapply(_state, patch_id)


def unapply_all():
    """Undo every patch, newest record first. Returns the ids that were undone."""
    from . import undo

    with _lock:
        if _state is None:
            return []
        return undo.unapply_all(_state)


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
        if _state.started:
            from . import proof

            proof.detach()  # the process record no longer reads this activation's records
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
    from . import applying, staleness

    out = {}
    for pid, rt in list(state.runtime.items()):
        if name in state.registry.specs[pid].targets:
            applying.on_import(state, state.generation, pid, name, module)
        elif staleness.changed_module(rt, name):
            for target in list(rt.applied_targets):
                if sys.modules.get(target) is not None:
                    applying.on_import(state, state.generation, pid, target, sys.modules[target])
        else:
            continue
        out[pid] = rt.state
    return out


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
        from . import staleness

        with _lock:
            for rt in state.runtime.values():
                staleness.check_in_place(rt)
    return Snapshot(state)


def run(patch_id):
    """``patch_id``'s :class:`~omni_patches.runs.PatchRun` in this activation, or None (inactive, not started,
    unknown id)."""
    state = _state
    return state.runtime.get(patch_id) if state is not None else None


def registry_errors():
    with _lock:
        reg = _state.registry if _state is not None else registry.load()
        return list(reg.errors)
