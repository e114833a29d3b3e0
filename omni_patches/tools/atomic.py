"""Atomic cache entries: built once, under a lock, never seen half-built -- the one way ``omni-patches audit``
and the test-suite fetch and unpack release files.

* :func:`locked` -- an exclusive ``flock`` on ``<cache>/.<key>.lock`` (parallel audits, pytest-xdist workers);
* :func:`build_once` -- a directory filled in ``<dest>.part`` and renamed into place with a ``.complete`` marker
  (whose text names how it was built: an entry built another way is rebuilt);
* :func:`link_or_copy` -- a hard link where the file system allows, else a copy (``copytree``'s
  ``copy_function`` for trees made from cached ones);
* :func:`extract` -- the wanted regular files of a wheel, zip or sdist, member names checked (no absolute path,
  ``..`` or NUL), with ``tarfile``'s ``data`` filter where the interpreter has it.
"""
import contextlib
import fcntl
import os
import re
import shutil
import tarfile
import zipfile

COMPLETE = ".complete"


def link_or_copy(src, dst):
    """Hard-link ``src`` to ``dst``; copy it where that fails (another file system, one without hard links). A
    caller that edits ``dst`` later replaces the file (unlink, then write), never writing through the link."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


class UnsafeArchive(Exception):
    """An archive member that may not be written under the destination."""


@contextlib.contextmanager
def locked(cache, key):
    """Hold ``<cache>/.<key>.lock`` exclusively (the cache directory is created)."""
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, f".{key}.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def held_if_free(path):
    """Hold the lock file ``path`` (created if missing) only if nobody else holds it: yields True while held, or
    False at once when another process has it (for work that may be skipped, e.g. a clean-up)."""
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_free(cache, key):
    """Whether nobody holds ``<cache>/.<key>.lock`` now (so a ``.part`` of that key is debris, not work)."""
    path = os.path.join(cache, f".{key}.lock")
    if not os.path.exists(path):
        return True
    with held_if_free(path) as held:
        return held


def is_complete(dest, marker=""):
    """Whether ``dest`` was built completely, the way ``marker`` names."""
    try:
        with open(os.path.join(dest, COMPLETE)) as fh:
            return fh.read() == marker
    except OSError:
        return False


def build_once(dest, fill, *, cache, key=None, marker=""):
    """``dest``, filled once by ``fill(tmp)`` in ``<dest>.part`` under the lock ``key`` (default its name) and
    renamed into place: a build that failed or was killed is never taken for a finished one, a finished one is
    never rebuilt (unless its ``marker`` differs: then it is replaced)."""
    dest = os.fspath(dest)
    if is_complete(dest, marker):
        return dest
    with locked(cache, key or os.path.basename(dest)):
        if is_complete(dest, marker):
            return dest
        tmp = dest + ".part"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            fill(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with open(os.path.join(tmp, COMPLETE), "w") as fh:
            fh.write(marker)
        old = dest + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.lexists(dest):
            os.replace(dest, old)  # two renames: a reader sees the old tree or the new one, never half of one
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    return dest


def unsafe(name):
    """Why an archive member name may not be written under the extraction directory, or None."""
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return "an absolute path"
    if ".." in re.split(r"[/\\]", name):
        return "a '..' component"
    if "\0" in name:
        return "a NUL byte"
    return None


def _checked(names):
    for name in names:
        why = unsafe(name)
        if why:
            raise UnsafeArchive(f"unsafe member {name!r} ({why})")
    return names


def extract(archive, dest, wanted=lambda name: True):
    """Extract the regular files of ``archive`` (wheel / zip / tar) whose names ``wanted`` accepts into ``dest``.

    Only regular files are taken (never links, devices or fifos), and every name is checked first. Where
    ``tarfile`` has extraction filters (3.10.12+, 3.11.4+, 3.12+) the ``data`` filter checks again; older
    interpreters (Debian 12's 3.11.2) have no ``filter`` argument: each file is written here, its mode plain.
    Raises :class:`UnsafeArchive`, or what reading the archive raises (OSError, zipfile/tarfile errors).
    """
    archive = os.fspath(archive)
    if archive.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            names = [i.filename for i in zf.infolist() if not i.is_dir() and wanted(i.filename)]
            zf.extractall(dest, _checked(names))
        return
    with tarfile.open(archive) as tf:
        members = [m for m in tf.getmembers() if m.isfile() and wanted(m.name)]
        _checked([m.name for m in members])
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, members, filter="data")
            return
        root = os.path.realpath(dest)
        for m in members:
            path = os.path.realpath(os.path.join(root, m.name))
            if os.path.commonpath([root, path]) != root:  # pragma: no cover - _checked() already refused it
                raise UnsafeArchive(f"unsafe member {m.name!r} (outside the destination)")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            src = tf.extractfile(m)
            with src, open(path, "wb") as out:
                shutil.copyfileobj(src, out)
