"""Undo: every attribute a patch replaced is restored to the exact original object, newest record first.

Works on the engine's activation state, passed in (``order``: every undo record in the order installed, across
patches; ``runtime``: ``{patch id: PatchRun}``); the caller holds the engine's lock.
"""
from . import flags


def undo_records(state, rt):
    """Undo what ``rt``'s patch installed; returns the problems (records someone else wrapped on top of)."""
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


def unapply(state, patch_id):
    """Undo one patch. True if something was restored; unknown or never-applied ids give False."""
    from . import log, strict
    from .states import Cause, State

    if patch_id not in state.runtime:
        return False
    rt = state.runtime[patch_id]
    if not rt.records and rt.state is not State.APPLIED:
        if rt.state is State.PENDING:
            rt.set(State.DISABLED, "unapplied at runtime", Cause.UNAPPLIED)
        return False
    problems = undo_records(state, rt)
    if problems:
        msg = f"{patch_id}: could not undo everything: " + "; ".join(problems)
        if flags.strict():
            raise strict.error(msg)
        log.get().error(msg)
        return False
    rt.set(State.DISABLED, "unapplied at runtime (omni_patches.unapply)", Cause.UNAPPLIED)
    log.get().info("%s: unapplied", patch_id)
    return True


def unapply_all(state):
    """Undo every patch, newest record first. Returns the ids that were undone."""
    done = []
    for record in reversed(list(state.order)):
        pid = record.patch_id
        if pid not in done:
            done.append(pid)
    return [pid for pid in done if unapply(state, pid)]
