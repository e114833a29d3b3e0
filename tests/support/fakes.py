"""Made-up target distributions for the engine's tests (the builder's :func:`~omni_patches.testing.releases.fake`,
written into a test's own directory), and registry text."""
from __future__ import annotations

from pathlib import Path

from omni_patches.testing import releases


def make_dist(site: Path, dist: str, version: str, files: dict[str, str]) -> Path:
    """``files`` (relative path -> source) of a made-up distribution, with its dist-info, written into ``site``."""
    modules = {rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__"): text for rel, text in files.items()}
    return releases.fake(dist, version, modules).write(site)


FAKE_LOADER = '''
    """A stand-in target: a module function, a class with every kind of method, and a consumer import."""
    import threading

    CALLS = []

    def compute(x, scale=1):
        return x * scale

    class Mixin:
        @classmethod
        def load(cls, x):
            return (cls.__name__, x)

        @staticmethod
        def helper(x):
            return x + 1

        def method(self, x):
            return x - 1

    class Child(Mixin):
        pass
'''

FAKE_CONSUMER = '''
    from fakeomni.loader import compute
'''


def fake_omni(site: Path, version: str = "0.28.0", *, loader: str = FAKE_LOADER) -> Path:
    return make_dist(site, "fake-omni", version, {
        "fakeomni/__init__.py": "",
        "fakeomni/loader.py": loader,
        "fakeomni/consumer.py": FAKE_CONSUMER,
    })


def registry_text(*entries: dict) -> str:
    """Render ``[[patch]]`` tables (enough TOML for tests; values are str/bool/list/dict of str)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f'"{k}" = {val(x)}' for k, x in v.items()) + " }"
        raise TypeError(v)

    out = []
    for e in entries:
        out.append("[[patch]]")
        out.extend(f"{k} = {val(v)}" for k, v in e.items())
        out.append("")
    return "\n".join(out)


def entry(pid="fake-double", **over):
    base = {
        "id": pid,
        "summary": "doubles fakeomni.loader.compute",
        "upstream": ["https://example.invalid/pr/1"],
        "why": "test",
        "remove_when": "never",
        "default": True,
        "requires": {"fake-omni": ">=0.27.0rc1,<0.30.0rc1"},
        "fixed_in": {"fake-omni": "0.30.0rc1"},
        "targets": ["fakeomni.loader", "fakeomni.consumer"],
        "module": "fakepatches.double",
    }
    base.update(over)
    return base


def zip_dir(site, path):
    """``path``: a zip (a wheel) of every file under ``site``, stored by its relative name."""
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        for f in sorted(site.rglob("*")):
            if f.is_file():
                zf.write(f, f.relative_to(site).as_posix())
    return path
