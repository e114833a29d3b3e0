"""Whether what a patch installed is still in place: ``importlib.reload`` of a target re-creates its functions and
classes, stock, and leaves the patch's objects on the old ones that nothing reaches any more.

An applied patch whose objects are gone is ``reverted`` (never ``applied``); its import hook firing again for the
reloaded module (or ``engine.reapply``) applies it once more.
"""
import sys


def stale(records):
    """Labels of the records whose installed object is no longer in place (see wrapping.Installed.in_place)."""
    return [r.label for r in records if not getattr(r, "in_place", lambda: True)()]


def check_in_place(rt):
    """An applied patch whose installed objects are gone -- ``importlib.reload`` of a target re-creates its
    functions and classes, stock -- is ``reverted``, and says which; fine again once re-applied."""
    from .states import State

    if rt.state not in (State.APPLIED, State.REVERTED):
        return
    gone = stale(rt.records)
    if gone:
        rt.set(State.REVERTED, f"applied to {', '.join(rt.applied_targets)}, but no longer in place: "
               f"{', '.join(gone)} (the module was reloaded or the attribute replaced since): stock code runs there")
    elif rt.state is State.REVERTED:
        rt.set(State.APPLIED, "patched " + ", ".join(rt.applied_targets))


def forget_stale(state, rt, target):
    """The hook fired again for ``target`` (a reloaded module): if what it installed there is gone, undo what
    is left of it and forget it, so that it applies once more (True); False when it is all in place.
    ``state``: the engine's activation state, whose ``order`` lists every undo record."""
    records = rt.by_target.get(target, [])
    if not stale(records):
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


def changed_module(rt, name):
    """Whether ``rt``'s patch changed something that lives in module ``name`` (a helper module one of its
    targets calls), as its undo records say."""
    return any(_module_of(getattr(r, "owner", None)) == name for r in rt.records)


def _module_of(owner):
    return getattr(owner, "__name__", None) if isinstance(owner, type(sys)) else getattr(owner, "__module__", None)
