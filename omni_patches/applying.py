"""Applying a patch to a freshly imported target -- for real (the import hook) or as a dry run (``doctor``,
``omni-patches audit``) -- and saying once why it did not apply.

The engine passes its activation state in (``registry``, ``runtime``: ``{patch id: PatchRun}``, ``order``: every
undo record, ``lock``, ``generation``); nothing here reads a global of the engine. A patch that does not apply
leaves the target as it was: what the attempt installed is undone, and so is what earlier targets of the same
patch installed. Strict mode (``OMNI_PATCHES_STRICT=1``) raises drift and failures into the host's import.
"""
from . import flags


class Outcome:
    """Why a patch did not apply at one target: ``state`` (drifted / failed / skipped:version), ``cause``,
    ``exc`` (what the patch raised), ``words`` (its own text: the exception's message, with the exception's type
    for a failure) and ``reason`` (``label: words``, what ``status`` says)."""

    __slots__ = ("state", "cause", "exc", "label", "words")

    def __init__(self, state, cause, exc, label, words):
        self.state, self.cause, self.exc, self.label, self.words = state, cause, exc, label, words

    @property
    def reason(self):
        return f"{self.label}: {self.words}"


def attempt(spec, target, module, rt, dry_run):
    """Run the patch's ``check`` and ``apply`` on ``module``. Returns ``(sink, None)`` when it went through, else
    ``(sink, Outcome)`` -- what was installed before it stopped is in ``sink``."""
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
        return sink, Outcome(State.VERSION, Cause.FIXED_UPSTREAM, exc, Cause.FIXED_UPSTREAM, str(exc))
    except NotAffected as exc:  # the code predates the bug (decided by features): a skip, never drift
        return sink, Outcome(State.VERSION, Cause.NOT_AFFECTED, exc, Cause.NOT_AFFECTED, str(exc))
    except Drift as exc:
        return sink, Outcome(State.DRIFTED, None, exc, target, str(exc))
    except Exception as exc:
        return sink, Outcome(State.FAILED, None, exc, target, f"{type(exc).__name__}: {exc}")
    rt.found.extend(f for f in ctx.found if f not in rt.found)
    return sink, None


def on_import(state, generation, patch_id, target, module):
    """wrapt post-import hook (bound to the activation ``state`` and its ``generation``: after ``deactivate`` it
    does nothing). Must never raise into the host's import unless strict."""
    try:
        if state.generation != generation:
            return
        apply_target(state, patch_id, target, module)
    except Exception as exc:
        if flags.strict():
            from . import strict

            raise strict.error(f"{patch_id}: unexpected error in the import hook for {target}: "
                               f"{type(exc).__name__}: {exc}", exc)
        from . import log

        log.once(40, ("hook", patch_id, target), "%s: unexpected error in the import hook for %s; "
                 "running unpatched", patch_id, target, exc_info=True)


def apply_target(state, patch_id, target, module):
    """Apply ``patch_id`` to its imported ``target`` once; returns the patch's state after it."""
    from . import log, needs, proof, staleness, undo
    from .states import State

    with state.lock:
        rt = state.runtime[patch_id]
        if rt.state not in (State.PENDING, State.APPLIED, State.REVERTED):
            return rt.state
        if target in rt.applied_targets and not staleness.forget_stale(state, rt, target):
            return rt.state  # what it installed is in place: never wrap twice
        spec = state.registry.specs[patch_id]
        sink, outcome = attempt(spec, target, module, rt, dry_run=False)
        if outcome is not None:
            for record in reversed(sink):  # what this attempt installed, then what earlier targets did
                record.undo()
            undo.undo_records(state, rt)
            rt.set(outcome.state, outcome.reason, outcome.cause)
            needs.log_needs(state)
            report_outcome(spec, target, rt, outcome)
            return rt.state
        rt.records.extend(sink)
        state.order.extend(sink)
        rt.by_target[target] = list(sink)
        rt.applied_targets.append(target)
        rt.set(State.APPLIED, "patched " + ", ".join(rt.applied_targets))
        staleness.check_in_place(rt)  # a target reloaded earlier may still be stock
        log.get().info("%s: applied to %s", patch_id, target)
        proof.applied(patch_id)  # per-process record, INFO line, gauge (never raises)
        needs.log_needs(state)
        return rt.state


def report_outcome(spec, target, rt, outcome):
    """Log why ``spec`` did not apply at ``target`` (once); strict mode turns drift and failure into errors."""
    from . import log, strict
    from .states import HARMLESS_CAUSES, Cause, State

    pid, exc = spec.id, outcome.exc
    if rt.cause in HARMLESS_CAUSES:
        key = "fixed" if rt.cause is Cause.FIXED_UPSTREAM else "not-affected"
        log.once(20, ("decision", pid, key), "%s: %s (%s)", pid, rt.state, rt.reason)
        return
    if rt.state is State.DRIFTED:
        log.once(30, ("decision", pid, "drift"), "%s: drifted, not applied (%s)", pid, outcome.reason)
        if flags.strict():
            raise strict.error(f"{pid}: drifted at {target}: {outcome.words} (nothing applied; patch module "
                               f"{spec.module})", exc)
        return
    log.once(40, ("decision", pid, "failed"), "%s: failed, not applied (%s)", pid, rt.reason, exc_info=exc)
    if flags.strict():
        raise strict.error(f"{pid}: failed at {target}: {outcome.words} (nothing applied; patch module "
                           f"{spec.module})", exc)


# -- dry runs ----------------------------------------------------------------------------------------------
class Absent(Exception):
    """Raised by a dry run's ``load``: the target is not there to check (not importable here, not in the given
    files): skipped, as it would be at run time; the message says why, when there is more to say."""


class LoadFailed(Exception):
    """Raised by a dry run's ``load``: the target is there but cannot be loaded (its message says why): the dry
    run stops, ``failed``."""


class DryRun:
    """What :func:`dry_run` found for one patch.

    ``state``: ``ready`` when every target that could be loaded passed its checks (``checked``: when it is empty
    nothing was checked, and each caller says what that means), else the state of the first one that did not
    (drifted / failed / skipped:version) with ``target``, ``reason`` (what ``status`` would say), ``cause`` and
    ``words`` (the patch's own text, or why the target could not be loaded). ``absent``: ``[(target, why)]`` of
    the targets that are not there; ``found``: what the patch recognised (``ctx.describe``).
    """

    __slots__ = ("state", "reason", "cause", "words", "target", "checked", "absent", "found")

    def __init__(self, state):
        self.state, self.reason, self.cause, self.words, self.target = state, "", None, "", None
        self.checked, self.absent, self.found = [], [], []


def dry_run(spec, decision, load):
    """Dry-run ``spec``'s ``check`` and ``apply`` on each of its targets as ``load(target)`` gives it (the imported
    module; :class:`Absent` or :class:`LoadFailed` when it cannot): nothing is wrapped, nothing logged, no
    activation's records touched. ``decision``: the gate's (pending). ``doctor`` loads by importing, ``omni-patches
    audit`` builds skeletons from release files: both judge a patch by this one run."""
    from .runs import PatchRun
    from .states import State

    out = DryRun(State.READY)
    for target in spec.targets:
        try:
            module = load(target)
        except Absent as exc:
            out.absent.append((target, str(exc)))
            continue
        except LoadFailed as exc:
            out.state, out.target, out.reason = State.FAILED, target, str(exc)
            out.words = out.reason
            return out
        rt = PatchRun(spec.id, decision)
        _, outcome = attempt(spec, target, module, rt, dry_run=True)  # a dry run installs nothing
        out.found.extend(f for f in rt.found if f not in out.found)
        if outcome is not None:
            out.state, out.target, out.reason = outcome.state, target, outcome.reason
            out.cause, out.words = outcome.cause, outcome.words
            return out
        out.checked.append(target)
    return out
