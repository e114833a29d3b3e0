"""What a patch module sees: the target being patched and the only sanctioned ways to change it.

A patch module defines ``apply(ctx)`` and optionally ``check(ctx)``. Both run once per imported target
(``ctx.target`` says which). Everything a patch changes must go through ``ctx.wrap`` / ``ctx.replace`` /
``ctx.on_undo`` so that it is idempotent, can be undone, and can be dry-run by ``omni-patches doctor``.
What a wrapper learns at call time (notes, fallbacks, counters, objects to restore) goes on ``ctx.run``, the
patch's record for this activation (:class:`omni_patches.runs.PatchRun`), never in module globals.
"""
import inspect

from . import versions, wrapping


class Drift(Exception):
    """The target no longer looks like the code this patch was written for: never apply."""


class FixedUpstream(Exception):
    """The target already contains the fix (a feature marker, not just a version): skip."""


class NotAffected(Exception):
    """The target predates the bug (it lacks the feature the bug lives in, e.g. a tagless checkout of an old
    release): skip. Decided by features, like FixedUpstream; never use it for code that merely looks different
    (that is Drift)."""


class _Callback:
    """Undo record for ``ctx.on_undo``: same interface as :class:`wrapping.Installed`."""

    __slots__ = ("fn", "patch_id")

    def __init__(self, fn, patch_id):
        self.fn, self.patch_id = fn, patch_id

    def undo(self):
        self.fn()


class PatchContext:
    def __init__(self, spec, target, module, installed, run=None, *, dry_run=False, sink=None):
        self.spec = spec
        self.patch_id = spec.id
        self.target = target
        self.module = module
        self.installed = dict(installed)
        if run is None:  # a context built by hand (a test applying a patch directly): a record of its own
            from .runs import PatchRun

            run = PatchRun.standalone(spec.id)
        self.run = run  # the patch's run-time record (omni_patches.runs.PatchRun): keep call-time state there
        self.dry_run = dry_run
        self._sink = sink if sink is not None else []
        self.found = []  # what ctx.describe() said about this target

    def describe(self, text):
        """Say which wrap point / layout this target matched, e.g.
        ``ctx.describe("AscendMoERunner.no_shared_forward_impl (v0.24-v0.26 layout)")``. Shown in
        ``status`` reasons and ``doctor`` / ``audit`` lines, and used when a source build is decided by
        features. Call it from ``check`` or ``apply`` (dry runs included)."""
        if text and text not in self.found:
            self.found.append(str(text))

    # -- reading the target --------------------------------------------------------------------
    def version(self, dist):
        """Installed version of ``dist`` as a comparable :class:`packaging.version.Version`, or None."""
        text = self.installed.get(dist) or versions.installed(dist)[1]
        return versions.comparable(text) if text else None

    def resolve(self, path, root=None):
        """``ctx.resolve("LoraLoaderMixin.load_lora_into_module")`` from the target module; Drift if absent."""
        obj = self.module if root is None else root
        done = []
        for part in path.split("."):
            try:
                obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
            except AttributeError:
                where = ".".join([getattr(root or self.module, "__name__", "?"), *done])
                raise Drift(f"{where} has no attribute {part!r}") from None
            done.append(part)
        return obj

    def has(self, path, root=None):
        try:
            self.resolve(path, root)
            return True
        except Drift:
            return False

    def own_function(self, cls_path, name):
        """The plain function ``name`` that the class at ``cls_path`` defines itself (not inherited, not already
        wrapped or made a descriptor); Drift otherwise."""
        cls = self.resolve(cls_path)
        if not isinstance(cls, type):
            raise Drift(f"{cls_path} is not a class")
        func = vars(cls).get(name)
        if not inspect.isfunction(func):
            raise Drift(f"{cls_path} defines no plain method {name}")
        return func

    def require_params(self, func, *names, label=None):
        """Drift unless ``func`` accepts every parameter in ``names``."""
        func = getattr(func, "__func__", func)
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError) as exc:
            raise Drift(f"cannot read the signature of {label or func!r}: {exc}") from None
        missing = [n for n in names if n not in params]
        if missing:
            raise Drift(f"{label or getattr(func, '__qualname__', func)} has no parameter(s) {', '.join(missing)} "
                        f"(has: {', '.join(params)})")
        return params

    def drift(self, message):
        raise Drift(message)

    def fixed_upstream(self, message):
        raise FixedUpstream(message)

    def not_affected(self, message):
        """This code predates the bug (``message`` names the missing feature): skipped, not drifted."""
        raise NotAffected(message)

    # -- at call time (used by the installed wrappers) -----------------------------------------
    # Wrappers keep ``run = ctx.run`` (a closure or functools.partial) and call these on it at call time.
    def note(self, text, key=None):
        """Attach a run-time note to this patch's ``status`` (e.g. which path a call took, once): a note with
        the same ``key`` (default: the patch id) replaces the previous one. See :meth:`PatchRun.note`."""
        return self.run.note(text, key)

    def fallback(self, reason):
        """The rule for every wrapper: one that meets an input it was not built for runs the original code
        (never raising where stock would not) and calls ``run.fallback("why")`` so ``status`` says so, once
        per reason. Returns True the first time ``reason`` is seen. See :meth:`PatchRun.fallback`."""
        return self.run.fallback(reason)

    def stock(self, reason, wrapped, args, kwargs):
        """``fallback(reason)``, then the original call: ``return run.stock("why", wrapped, args, kwargs)``."""
        return self.run.stock(reason, wrapped, args, kwargs)

    # -- changing the target -------------------------------------------------------------------
    def _owner(self, owner):
        return self.resolve(owner) if isinstance(owner, str) else owner

    def wrap(self, owner, name, wrapper):
        """Wrap ``owner.name`` with ``wrapper(wrapped, instance, args, kwargs)`` (wrapt semantics).

        ``owner`` is an object or a dotted path from the target module ("" = the module itself).
        """
        owner = self.module if owner == "" else self._owner(owner)
        self._exists(owner, name)
        if self.dry_run:
            return None
        new, record = wrapping.wrap(owner, name, wrapper, self.patch_id)
        if record is not None:
            self._sink.append(record)
        return new

    def replace(self, owner, name, make):
        """Install ``make(original)`` as ``owner.name``: a plain function, for hot paths."""
        owner = self.module if owner == "" else self._owner(owner)
        self._exists(owner, name)
        if self.dry_run:
            return None
        new, record = wrapping.replace(owner, name, make, self.patch_id)
        if record is not None:
            self._sink.append(record)
        return new

    def on_undo(self, fn):
        """Run ``fn()`` when the patch is unapplied (after the attributes installed later are restored)."""
        if not self.dry_run:
            self._sink.append(_Callback(fn, self.patch_id))

    def _exists(self, owner, name):
        try:
            wrapping.raw_attribute(owner, name)
        except AttributeError:
            raise Drift(f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))} has no attribute "
                        f"{name!r}") from None
