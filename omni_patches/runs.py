"""A patch's run-time record in this process: owned by the engine, given to the patch as ``ctx.run``.

One :class:`PatchRun` per patch and activation (``deactivate()`` and a new ``activate()`` start fresh ones). The
engine keeps its lifecycle fields (state, reason, cause, what it installed); the patch keeps what it learns at
call time on it -- notes shown in ``status``, fallbacks, counters, and any per-activation data
(:attr:`PatchRun.data`) -- never in module globals, so undo and a new activation leave nothing behind.
Readers (status, doctor, the process record) see it through :func:`omni_patches.engine.snapshot`; the engine
hands the process record's refresh in as ``on_note``, so a note shows there too.
"""
import threading

from .states import State

# Distinct fallback reasons noted per patch (run.fallback); more are logged once each but not listed.
MAX_FALLBACK_NOTES = 8


class PatchRun:
    __slots__ = ("patch_id", "decision", "state", "reason", "cause", "applied_targets", "records", "by_target",
                 "found", "notes", "fallbacks", "counts", "data", "on_note", "_lock")

    def __init__(self, patch_id, decision, on_note=None):
        self.patch_id = patch_id
        self.decision = decision
        self.state, self.reason, self.cause = State(decision.state), decision.reason, decision.cause
        self.applied_targets = []
        self.records = []  # Installed / callback records, in application order
        self.by_target = {}  # target -> the records its application installed (to re-apply after a reload)
        self.found = []  # ctx.describe() texts of the targets checked so far (wrap points, layouts)
        self.notes = {}  # key -> text, set at call time (e.g. a kernel chosen at first use)
        self.fallbacks = []  # distinct reasons a wrapper ran the original code
        self.counts = {}  # key -> how many times it happened (run.count)
        self.data = {}  # the patch's own per-activation state (e.g. objects to restore at undo)
        self.on_note = on_note  # called after a new note (the engine's: rewrite the process record); never raises
        self._lock = threading.Lock()

    @classmethod
    def standalone(cls, patch_id, on_note=None):
        """A record outside any activation: for a patch's builder called directly (a test, a benchmark); what
        it notes stays on the object."""
        from .gates import Decision

        return cls(patch_id, Decision(State.APPLIED, "outside the engine", {}, True), on_note)

    def set(self, state, reason, cause=None):
        self.state, self.reason, self.cause = State(state), reason, cause

    def full_reason(self):
        """The reason plus how the gate decided, what the patch found and noted: what ``status`` shows."""
        return "; ".join([self.decision.explain(self.reason, self.found), *self.notes.values()])

    def view(self):
        """``{"state", "reason", "targets", "notes"}``: what the process record keeps (no lock: a forked child may
        not get one). ``notes``: the call-time notes alone (also in ``reason``), for ``status --all-processes``."""
        return {"state": str(self.state), "reason": self.full_reason(), "targets": list(self.applied_targets),
                "notes": list(self.notes.values())}

    # -- at call time: cheap after the first time, never raise into the patched call ------------------
    def note(self, text, key=None):
        """Attach a note to ``status`` (same ``key``, default the patch id: replaced). Returns True when
        recorded."""
        try:
            key, text = key or self.patch_id, str(text)
            with self._lock:
                if self.notes.get(key) == text:
                    return True
                self.notes[key] = text
            if self.on_note is not None:
                self.on_note()  # the process record shows it too (a no-op until something applied)
            return True
        except Exception:  # pragma: no cover - a note must never break the caller
            return False

    def fallback(self, reason):
        """A wrapper met an input it was not built for and runs the original code instead: noted once per
        distinct ``reason`` ("ran the original code: <reason>") and logged once (INFO). Keep ``reason`` a fixed
        text (no per-call values): at most :data:`MAX_FALLBACK_NOTES` are listed. Returns True the first time."""
        try:
            with self._lock:
                if reason in self.fallbacks:
                    return False
                self.fallbacks.append(reason)
                n = len(self.fallbacks)
            from . import log

            log.once(20, ("fallback", self.patch_id, reason), "%s: ran the original code: %s", self.patch_id, reason)
            if n <= MAX_FALLBACK_NOTES:
                self.note(f"ran the original code: {reason}", key=("fallback", reason))
            else:
                self.note(f"ran the original code for {n - MAX_FALLBACK_NOTES} more kind(s) of input (see the log)",
                          key=("fallback", "more"))
            return True
        except Exception:  # pragma: no cover - a note must never break the caller
            return False

    def stock(self, reason, wrapped, args, kwargs):
        """:meth:`fallback`, then the original call: ``return run.stock("why", wrapped, args, kwargs)``."""
        self.fallback(reason)
        return wrapped(*args, **kwargs)

    def tally(self, key, text, *, by=1, log=None, level=20):
        """Count what stock would have got wrong and say so in ``status``: the counter ``key`` goes up by ``by`` and
        the note ``key`` becomes ``text.format(n=<the count>)``; the first time, ``log`` (a message, or None) is
        logged once at ``level`` with the patch id. Returns the count (0 if the bookkeeping failed): never raises
        into the patched call."""
        try:
            with self._lock:
                before = self.counts.get(key, 0)
                n = self.counts[key] = before + by
            self.note(text.format(n=n), key=key)
            if log is not None and before == 0:
                from . import log as logs

                logs.once(level, ("tally", self.patch_id, key), "%s: %s", self.patch_id, log)
            return n
        except Exception:  # pragma: no cover - bookkeeping must never break the caller
            return 0

    def count(self, key):
        """Add one to the counter ``key`` and return its new value (e.g. to say "3 clients dropped")."""
        with self._lock:
            n = self.counts[key] = self.counts.get(key, 0) + 1
        return n
