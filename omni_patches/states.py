"""The words of a patch's run-time record: its :class:`State` and the :class:`Cause` behind a skip.

Both are ``str`` subclasses whose values are the words operators read in ``status`` and in the process records
(``"applied"``, ``"skipped:version"``), so JSON, logs and string comparisons keep working. Kept apart from
:mod:`omni_patches.records` (dataclasses) because the engine imports it on the start-up path.
"""
import enum


class _Word(str, enum.Enum):
    __str__ = str.__str__  # "applied", never "State.APPLIED" (f-strings, logs, tables)
    __format__ = str.__format__
    __repr__ = str.__repr__  # 'applied', as the plain string it stands for (messages, printed records)


class State(_Word):
    APPLIED = "applied"
    PENDING = "pending"  # gated in; applies when its target is imported
    READY = "ready"  # doctor's dry run: would apply cleanly
    DISABLED = "skipped:disabled"
    VERSION = "skipped:version"  # out of its range, fixed upstream, or predating the bug (see Cause)
    ABSENT = "skipped:absent"
    DRIFTED = "drifted"
    FAILED = "failed"
    INACTIVE = "inactive"  # the shim is not active in this process; ``would`` says what it would be
    REVERTED = "reverted"  # applied, but what it installed is no longer in place (its module reloaded): stock runs


class Cause(_Word):
    """Why a patch is skipped (``None`` for the other states): decided by a gate or by the patch's features."""

    MASTER_OFF = "master switch off"
    SWITCHED_OFF = "switched off"
    UNAPPLIED = "unapplied at run time"
    NOT_INSTALLED = "not installed"
    OUT_OF_RANGE = "outside the affected range"
    BAD_VERSION = "version is not PEP 440"
    FIXED_UPSTREAM = "fixed upstream"
    NOT_AFFECTED = "not affected (predates the bug)"


STATES = tuple(State)
# The code has no bug to fix: a skip for these is news, not a problem (logged at INFO, audit's "skip: ..." verdicts),
# and a needed patch skipped for one leaves the patch that needs it correct (needs.needed_problem).
HARMLESS_CAUSES = (Cause.FIXED_UPSTREAM, Cause.NOT_AFFECTED)


def is_skipped(word):
    """Whether a state word -- a :class:`State`, or the text of one read back from a process record -- is one of
    the ``skipped:*`` states."""
    return str(word).startswith("skipped:")
