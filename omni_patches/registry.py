"""Load and validate ``patches.toml`` (plus ``OMNI_PATCHES_CONFIG`` overlays).

The shipped ``patches.toml`` is generated from the patch modules' ``TABLE`` literals
(:mod:`omni_patches.tools.tables`); an overlay's file is written by hand.

Runs at interpreter start-up when the shim is on, so it stays stdlib-only (``tomllib``); the checks that
need ``packaging`` (specifier syntax) run later, in :mod:`omni_patches.gates`, when a target is imported.
A bad entry never takes the others down: it is kept with ``error`` set and reported as ``failed``.
"""
import os

_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")


def is_id(value):
    """kebab-case: lower-case alphanumeric words joined by single hyphens (no ``re``: start-up path)."""
    return isinstance(value, str) and all(w and set(w) <= _ID_CHARS for w in value.split("-"))


def _is_dotted(value):
    return isinstance(value, str) and all(p.isidentifier() for p in value.split("."))

# key -> (python type, required for a new entry)
KEYS = {
    "id": (str, True),
    # Prose (omni_patches.prose.KEYS): read from the module's record, never from patches.toml; only an overlay
    # whose module has no record gives them here (then "summary" is required: checked with the gates).
    "summary": (str, False),
    "upstream": (list, False),
    "why": (str, False),
    "remove_when": (str, False),
    "default": (bool, True),
    "requires": (dict, True),
    "fixed_in": (dict, False),
    "targets": (list, True),
    "module": (str, True),
    # "features" (default): a source build's version (see versions.source_build) is not gated on; the patch's
    # own checks decide. "version": the patch cannot tell by code alone, so the number rule stays.
    "source_builds": (str, False),
    # Other patch ids this one is only correct with, where they apply (doctor fails while one is off/drifted).
    "needs": (list, False),
}
SOURCE_BUILDS = ("features", "version")


class PatchSpec:
    """One registry entry. ``error`` is None for a valid entry, else the message that makes it ``failed``."""

    __slots__ = ("id", "default", "requires", "fixed_in", "targets", "module", "source_builds", "needs", "source",
                 "key_sources", "error", "toml_prose", "_prose")

    def __init__(self, id, source):
        self.id = id
        self.source = source  # the file that declared the patch
        self.key_sources = {}  # key -> the file that set it last (an overlay may change a shipped entry)
        self.module = ""
        self.toml_prose = {}  # prose keys an overlay's table gave (its module has no record)
        self._prose = None
        self.default = True
        self.requires = {}
        self.fixed_in = {}
        self.targets = []
        self.source_builds = "features"
        self.needs = []
        self.error = None

    def prose(self):
        """``summary``, ``upstream``, ``why``, ``remove_when`` (and ``affected``, ``how``), read on first use from
        the module's record without importing it (:mod:`omni_patches.prose`); never at start-up."""
        if self._prose is None:
            from . import prose

            self._prose = prose.of(self)
        return self._prose

    def _set_prose(key):  # noqa: N805 - builds the setters below
        def setter(self, value):
            self.toml_prose[key] = value
            self._prose = None
        return setter

    summary = property(lambda self: self.prose()["summary"], _set_prose("summary"))
    upstream = property(lambda self: self.prose()["upstream"], _set_prose("upstream"))
    why = property(lambda self: self.prose()["why"], _set_prose("why"))
    remove_when = property(lambda self: self.prose()["remove_when"], _set_prose("remove_when"))
    del _set_prose

    def where(self, *keys):
        """The file(s) that set ``keys`` (the declaring file for keys never set): what a message must name."""
        files = [self.key_sources.get(k, self.source) for k in keys] or [self.source]
        return ", ".join(dict.fromkeys(files))

    def __repr__(self):
        return f"PatchSpec({self.id!r}, module={self.module!r}, error={self.error!r})"


class Registry:
    def __init__(self):
        self.specs = {}  # id -> PatchSpec, in declaration order
        self.errors = []  # file-level problems (unreadable file, TOML syntax)
        self.files = []


def builtin_path():
    """The registry shipped inside the package; a source checkout falls back to the repository's copy."""
    here = os.path.dirname(os.path.abspath(__file__))
    packaged = os.path.join(here, "patches.toml")
    if os.path.exists(packaged):
        return packaged
    return os.path.join(os.path.dirname(here), "patches.toml")


def config_paths(environ=os.environ):
    paths = [builtin_path()]
    extra = environ.get("OMNI_PATCHES_CONFIG", "")
    paths.extend(p for p in extra.split(os.pathsep) if p.strip())
    return paths


def load(paths=None, environ=os.environ):
    """Parse every registry file in order; later files add patches or override keys of earlier ones."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    reg = Registry()
    for path in paths if paths is not None else config_paths(environ):
        reg.files.append(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, ValueError) as exc:  # TOMLDecodeError, and UnicodeDecodeError for a binary file
            reg.errors.append(f"{path}: cannot read registry: {type(exc).__name__}: {exc}")
            continue
        _merge(reg, path, data)
    for spec in reg.specs.values():
        unknown = [n for n in spec.needs if n not in reg.specs]
        if unknown and spec.error is None:
            spec.error = f"{spec.where('needs')}: patch {spec.id!r}: key 'needs' names unknown patch(es) {unknown}"
    return reg


def _merge(reg, path, data):
    for key in data:
        if key != "patch":
            reg.errors.append(f"{path}: unknown top-level key {key!r} (expected [[patch]] tables)")
    entries = data.get("patch", [])
    if not isinstance(entries, list):
        reg.errors.append(f"{path}: 'patch' must be an array of tables ([[patch]])")
        return
    seen = set()
    for n, entry in enumerate(entries, 1):
        pid = entry.get("id") if isinstance(entry, dict) else None
        if not is_id(pid):
            reg.errors.append(f"{path}: patch #{n}: 'id' must be a kebab-case string, got {pid!r}")
            continue
        if pid in seen:
            reg.errors.append(f"{path}: duplicate id {pid!r} in the same file; the first one is kept")
            spec = reg.specs[pid]
            spec.error = spec.error or f"{path}: duplicate id {pid!r}"
            continue
        seen.add(pid)
        spec = reg.specs.get(pid)
        new = spec is None
        if new:
            spec = reg.specs[pid] = PatchSpec(pid, path)
        problems = _apply_keys(spec, entry, new, path)
        if problems:  # added to the problems of earlier files, never replacing them
            spec.error = "; ".join([*([spec.error] if spec.error else []),
                                    *(f"{path}: patch {pid!r}: {p}" for p in problems)])


def _apply_keys(spec, entry, new, path):
    problems = []
    for key, value in entry.items():
        if key not in KEYS:
            problems.append(f"unknown key {key!r}")
            continue
        typ, _ = KEYS[key]
        if not isinstance(value, typ):
            problems.append(f"key {key!r} must be {typ.__name__}, got {type(value).__name__}")
            continue
        problem = _check_value(key, value)
        if problem:
            problems.append(problem)
            continue
        if key != "id":
            setattr(spec, key, value)
            spec.key_sources[key] = path
    if new:
        missing = [k for k, (_, req) in KEYS.items() if req and k not in entry]
        if missing:
            problems.append("missing key(s) " + ", ".join(repr(m) for m in missing))
    return problems


def _check_value(key, value):
    if key in ("requires", "fixed_in"):
        bad = [k for k, v in value.items() if not isinstance(v, str)]
        if bad:
            return f"key {key!r}: values must be strings (PEP 440), not for {bad}"
    elif key == "targets":
        bad = [t for t in value if not _is_dotted(t)]
        if bad or not value:
            return f"key 'targets' must be a non-empty list of import names, bad: {bad}"
    elif key == "module":
        if not _is_dotted(value):
            return f"key 'module' is not an import name: {value!r}"
    elif key == "upstream":
        if not all(isinstance(u, str) for u in value):
            return "key 'upstream' must be a list of strings"
    elif key == "source_builds":
        if value not in SOURCE_BUILDS:
            return f"key 'source_builds' must be one of {', '.join(SOURCE_BUILDS)}, got {value!r}"
    elif key == "needs":
        if not all(is_id(n) for n in value):
            return f"key 'needs' must be a list of patch ids, got {value!r}"
    return None
