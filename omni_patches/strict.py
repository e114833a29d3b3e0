"""Strict mode (``OMNI_PATCHES_STRICT=1``): the one error every problem becomes, and the problems found before any
patch runs (the registry, the ``OMNI_PATCHES*`` variables), logged once and raised together in strict mode.

Without strict mode the same problems are logged once and the host runs unpatched where it must. Nothing here is
imported at interpreter start unless a problem is found there.
"""
from . import flags, registry


class StrictModeError(RuntimeError):
    """OMNI_PATCHES_STRICT=1 and something is wrong: raised into the host program's import."""

    # The name tracebacks print, and the one operators catch and grep (docs/how-it-works.md): the engine's.
    __module__ = "omni_patches.engine"


PREFIX = "omni-patches (OMNI_PATCHES_STRICT=1): "


def error(problem, cause=None):
    """The StrictModeError for ``problem`` (one text naming file / patch / target), chained to ``cause``."""
    if isinstance(cause, StrictModeError):
        return cause
    err = StrictModeError(PREFIX + problem)
    err.__cause__ = cause
    return err


class Stop:
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
        raise StrictModeError(PREFIX + " | ".join(problems))

    def invalidate_caches(self):  # part of the finder protocol
        pass


def report_registry(reg, check_env=True):
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
            raise StrictModeError(PREFIX + " | ".join(problems))
