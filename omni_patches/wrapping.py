"""The two ways a patch replaces an attribute, each recorded so it can be undone exactly.

* :func:`wrap` installs a ``wrapt`` FunctionWrapper (functions, methods, classmethods, staticmethods):
  the default, correct for every kind of callable and descriptor.
* :func:`replace` installs a plain function built from the original: for hot paths where wrapt's
  ~0.5-1 us per call matters (a MoE runner's forward runs ~60 times per step).

Both mark what they install with the patch id so a second application is a no-op, and both keep the
replacement picklable by reference (a spawn ``Process(target=wrapped)`` must still work).
"""
import functools
import importlib
import sys

import wrapt

_MISSING = object()


def _load_by_name(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _BoundPatchWrapper(wrapt.BoundFunctionWrapper):
    def __reduce_ex__(self, protocol):
        owner = self._self_instance
        if owner is None:
            return _load_by_name, (self.__module__, self.__qualname__)
        return getattr, (owner, self.__name__)


class PatchWrapper(wrapt.FunctionWrapper):
    """A FunctionWrapper that knows which patch installed it and pickles by qualified name."""

    __bound_function_wrapper__ = _BoundPatchWrapper

    def __init__(self, wrapped, wrapper, patch_id):
        super().__init__(wrapped, wrapper)
        self._self_patch_id = patch_id

    def __reduce_ex__(self, protocol):
        return _load_by_name, (self.__module__, self.__qualname__)


def installed_by(obj):
    """Ids of the omni-patches layers on ``obj`` (outermost first)."""
    ids = []
    seen = 0
    while obj is not None and seen < 32:
        seen += 1
        if isinstance(obj, PatchWrapper):
            ids.append(obj._self_patch_id)
            obj = obj.__wrapped__
            continue
        inner = getattr(obj, "__func__", None)  # classmethod / staticmethod descriptors
        pid = getattr(inner if inner is not None else obj, "__omni_patch__", None)
        if pid is None:
            break
        ids.append(pid)
        obj = getattr(inner if inner is not None else obj, "__wrapped__", None)
    return ids


def _by_name(owner):
    """The object ``owner.__module__`` exposes under ``owner.__qualname__`` now, or None. Reads ``vars()``
    only: a lazy module's ``__getattr__`` must not run (nor import anything)."""
    module = sys.modules.get(getattr(owner, "__module__", None) or "")
    qualname = getattr(owner, "__qualname__", None)
    if module is None or not isinstance(qualname, str):
        return None
    obj = module
    for part in qualname.split("."):
        try:
            obj = vars(obj).get(part)
        except TypeError:
            return None
        if obj is None:
            return None
    return obj


class Installed:
    """Undo record: what was in ``owner.__dict__[name]`` before, and what we put there."""

    __slots__ = ("owner", "name", "had_own", "original", "installed", "patch_id", "reachable")

    def __init__(self, owner, name, had_own, original, installed, patch_id):
        self.owner, self.name, self.had_own = owner, name, had_own
        self.original, self.installed, self.patch_id = original, installed, patch_id
        self.reachable = not isinstance(owner, type(importlib)) and _by_name(owner) is owner

    @property
    def label(self):
        owner = self.owner
        where = owner.__name__ if isinstance(owner, type(importlib)) else f"{owner.__module__}.{owner.__qualname__}"
        return f"{where}.{self.name}"

    def in_place(self):
        """Whether the owner still holds what was installed, and is still the object its module exposes.

        ``importlib.reload`` of the target re-executes the module: its functions and classes are new, stock
        objects (our wrapper stays only on the old class, which nothing reaches any more).
        """
        owner = self.owner
        if self.gone():  # under another patch's (or the host's) wrapper it is still in place
            return False
        if isinstance(owner, type(importlib)):
            return sys.modules.get(owner.__name__, owner) is owner
        # a class: compared only if its module exposed it under its qualified name when it was patched
        return not self.reachable or _by_name(owner) is owner

    def gone(self):
        """Whether nothing of what was installed is left on the owner's attribute (replaced wholesale, e.g. by a
        reload): then there is nothing to undo. False while it is there, also under someone else's wrapper."""
        current = vars(self.owner).get(self.name, _MISSING)
        for _ in range(32):
            if current is self.installed:
                return False
            # A wrapper's own __wrapped__ first: a wrapt wrapper around a classmethod passes __func__ through to
            # the innermost function, skipping every layer in between (two patches on one classmethod).
            nxt = getattr(current, "__wrapped__", _MISSING)
            if nxt is _MISSING:
                inner = getattr(current, "__func__", None)
                nxt = getattr(inner, "__wrapped__", _MISSING) if inner is not None else _MISSING
            if nxt is _MISSING or nxt is None:
                break
            current = nxt
        return True

    def undo(self):
        current = vars(self.owner).get(self.name, _MISSING)
        if current is not self.installed:
            raise RuntimeError(
                f"{self.label} was replaced by something else after {self.patch_id} patched it; "
                "undo that first (omni_patches.unapply_all() undoes in reverse order)"
            )
        if self.had_own:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)  # the original was inherited: remove our shadowing attribute


class Alias(Installed):
    """A binding that already held this patch's replacement when the patch reached it -- typically a
    ``from x import f`` executed after ``x.f`` was patched. Undo points it back at the original."""

    __slots__ = ()

    def undo(self):
        current = vars(self.owner).get(self.name, _MISSING)
        if current is self.original:
            return
        super().undo()


def _peel(obj, patch_id):
    """The object under ``patch_id``'s layer, if that layer is the outermost one of ``obj``; else None."""
    if isinstance(obj, PatchWrapper):
        return obj.__wrapped__ if obj._self_patch_id == patch_id else None
    inner = getattr(obj, "__func__", None)
    func = inner if inner is not None else obj
    if getattr(func, "__omni_patch__", None) != patch_id:
        return None
    original = func.__wrapped__
    return type(obj)(original) if inner is not None else original


def _already(owner, name, raw, own, patch_id):
    """``raw`` already carries this patch: nothing to install; record an alias if it is a binding of its own."""
    original = _peel(raw, patch_id) if own else None
    return raw, (Alias(owner, name, True, original, raw, patch_id) if original is not None else None)


def raw_attribute(owner, name):
    """``(value as stored, stored on owner itself?)`` without triggering descriptor binding."""
    if isinstance(owner, type):
        for cls in owner.__mro__:
            if name in vars(cls):
                return vars(cls)[name], cls is owner
        raise AttributeError(f"{owner.__qualname__} has no attribute {name!r}")
    d = vars(owner)
    if name in d:
        return d[name], True
    return getattr(owner, name), False


def wrap(owner, name, wrapper, patch_id):
    """Wrap ``owner.name`` with a wrapt-style ``wrapper(wrapped, instance, args, kwargs)``.

    Returns ``(object now installed, undo record)``; if this patch's wrapper is already there (a consumer's
    ``from x import f`` taken after ``x.f`` was wrapped) nothing is installed and the record is an
    :class:`Alias`, or None when there is nothing of its own to restore.
    """
    raw, own = raw_attribute(owner, name)
    if patch_id in installed_by(raw):
        return _already(owner, name, raw, own, patch_id)
    new = PatchWrapper(raw, wrapper, patch_id)
    setattr(owner, name, new)
    return new, Installed(owner, name, own, raw, new, patch_id)


def replace(owner, name, make, patch_id):
    """Replace ``owner.name`` with ``make(original_function)``; keeps classmethod/staticmethod kind."""
    raw, own = raw_attribute(owner, name)
    if patch_id in installed_by(raw):
        return _already(owner, name, raw, own, patch_id)
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    func = raw.__func__ if kind else raw
    new_func = make(func)
    functools.update_wrapper(new_func, func)
    new_func.__omni_patch__ = patch_id
    new = kind(new_func) if kind else new_func
    setattr(owner, name, new)
    return new, Installed(owner, name, own, raw, new, patch_id)
