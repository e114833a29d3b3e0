"""The heavy half of activation, run once at the first import of a target package: the registry's problems
reported, every patch gated on the installed versions, and a wrapt post-import hook registered per target.

Imports wrapt and packaging (never at interpreter start). The engine passes its activation state in; a failure
here leaves the host running unpatched and says why once (``OMNI_PATCHES_STRICT=1``: raises).
"""
from . import flags


def start(state):
    """Gate every patch of ``state.registry`` and register its import hooks; returns wrapt's import finder (None
    when wrapt cannot be imported). The caller holds the engine's lock and has marked ``state`` started."""
    from . import proof
    from .states import State

    try:  # instance id here, not at activation: `OMNI_PATCHES=1 ray start` must not mint one for its node
        proof.ensure_instance()
        proof.attach(lambda: dict(state.runtime))  # the process record reads the patches' records from here
    except Exception:  # pragma: no cover - neither raises; the import cannot stop the shim
        pass
    try:
        import functools

        import wrapt

        from . import applying, gates, log, needs, strict
        from .runs import PatchRun

        strict.report_registry(state.registry)
        master = True if state.forced else None
        for spec in state.registry.specs.values():
            decision = gates.decide(spec, master=master)
            rt = state.runtime[spec.id] = PatchRun(spec.id, decision, on_note=proof.refresh)
            if decision.state != State.PENDING:
                level = 40 if decision.state == State.FAILED else 20
                log.once(level, ("decision", spec.id), "%s: %s (%s)", spec.id, decision.state, decision.explain())
                continue
            log.get().debug("%s: waiting for %s", spec.id, ", ".join(spec.targets))
            for target in spec.targets:
                hook = functools.partial(applying.on_import, state, state.generation, spec.id, target)
                wrapt.register_post_import_hook(hook, target)
                if rt.state not in (State.PENDING, State.APPLIED):
                    break  # an already-imported target drifted or failed: the rest would be undone anyway
        needs.log_needs(state)
    except Exception as exc:
        state.start_error = f"{type(exc).__name__}: {exc}"
        if flags.strict():
            from . import strict

            raise strict.error(f"could not start: {state.start_error}", exc)
        from . import log

        log.get().exception("omni-patches could not start; running unpatched")
    proof.started()  # listed by `status --all-processes` even where no patch applies (never raises)
    return wrapt_finder()


def wrapt_finder():
    """wrapt's import-hook finder on ``sys.meta_path``, or None."""
    import sys

    try:
        import wrapt.importer
    except ImportError:  # start() already logged it; never break the host's import over it
        return None

    for finder in sys.meta_path:
        if isinstance(finder, wrapt.importer.ImportHookFinder):
            return finder
    return None
