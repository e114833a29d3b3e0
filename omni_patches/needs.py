"""A patch's ``needs`` (registry key): other patches it is only correct with, where they apply.

One rule (:func:`needed_problem`) for the two places that say so: the engine's log, once, when an applied patch's
needed patch ends off, drifted, failed or out of range (:func:`log_needs`), and the warnings ``status`` /
``doctor`` put on the records (:func:`with_needs`).
"""
from .states import HARMLESS_CAUSES, State

# A needed patch in one of these states leaves the patch that needs it correct.
_NEEDED_OK = (State.APPLIED, State.PENDING, State.READY, State.ABSENT)


def needed_problem(state, cause, reason):
    """Why a patch in ``state`` (``cause``, ``reason``) that another one needs leaves that one incorrect here,
    or None."""
    if state in _NEEDED_OK or (state is State.VERSION and cause in HARMLESS_CAUSES):
        return None
    return f"{state} ({reason})"


def log_needs(state):
    """Log once when an applied patch's needed patch ended disabled, drifted, failed or out of range.
    ``state``: the engine's activation state (its registry and ``runtime``, ``{patch id: PatchRun}``)."""
    from . import log

    for spec in state.registry.specs.values():
        rt = state.runtime.get(spec.id)
        if rt is None or rt.state is not State.APPLIED:
            continue
        for other in spec.needs:
            ort = state.runtime.get(other)
            if ort is None:
                continue
            why = needed_problem(ort.state, ort.cause, ort.full_reason())
            if why:
                log.once(30, ("needs", spec.id, other, str(ort.state)), "%s: applied, but it needs %s on this stack, "
                         "which is %s: the result is not correct here", spec.id, other, why)


def with_needs(reg, records):
    """``records`` (PatchStatus), each applied/pending/ready one whose ``needs`` are off, drifted or out of range
    here with the warning on it."""
    import dataclasses

    by_id = {r.id: r for r in records}
    out = []
    for rec in records:
        spec = reg.specs.get(rec.id)
        warnings = []
        if spec is not None and rec.state in (State.APPLIED, State.PENDING, State.READY):
            for other in spec.needs:
                o = by_id.get(other)
                why = needed_problem(o.state, o.cause, o.reason) if o is not None else "not in the registry"
                if why:
                    warnings.append(f"needs {other} on this stack, which is {why}: {rec.id} alone is not correct here")
        if warnings:
            rec = dataclasses.replace(rec, warnings=tuple(warnings),
                                      reason=rec.reason + "; WARNING: " + "; ".join(warnings))
        out.append(rec)
    return out
