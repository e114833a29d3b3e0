"""Fetch one release file straight from a package index (PEP 691 JSON simple API), without pip's resolver.

pip cannot download some sdists without building their metadata first (vllm-ascend 0.27.1rc1 and later need
setuptools_scm, CANN variables and more). The file itself is on the index: ``GET <index>/<project>/`` with
``Accept: application/vnd.pypi.simple.v1+json`` lists every file with its URL and hash. Used by
``omni-patches audit`` and by the test-suite's wheel cache. Stdlib only.

The index is pip's own: ``PIP_INDEX_URL``, else ``index-url`` from ``pip config`` (``download`` section first, then
``global``), else PyPI.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request

PYPI = "https://pypi.org/simple/"
ACCEPT = "application/vnd.pypi.simple.v1+json"


class IndexLookupError(Exception):
    """The index could not be asked, or has no such file."""


class FetchTimeout(IndexLookupError):
    """The fetch did not finish within its own time limit (an index that accepts and never answers)."""


class Deadline:
    """One wall-clock budget for a whole fetch (every request and read in it), whatever the socket does."""

    def __init__(self, seconds, what="the fetch"):
        import time

        self.seconds, self.what = seconds, what
        self.end = None if seconds is None else time.monotonic() + seconds

    def remaining(self, cap=None):
        """Seconds left (at most ``cap``); FetchTimeout once none are."""
        import time

        if self.end is None:
            return cap
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left if cap is None else min(left, cap)

    def expired(self):
        return FetchTimeout(f"{self.what} did not finish within {self.seconds:g} s")


def _read_all(resp, deadline, sink):
    """Copy ``resp`` into ``sink(chunk)`` one socket read at a time, checking ``deadline`` between reads: a
    server that trickles bytes cannot stretch one ``read(n)`` past it."""
    sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
    while True:
        if deadline is not None and sock is not None:
            sock.settimeout(deadline.remaining(60))
        chunk = resp.read1(1 << 20) if hasattr(resp, "read1") else resp.read(1 << 20)
        if not chunk:
            return
        sink(chunk)


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def index_url(environ=os.environ):
    """pip's configured index URL (always ending in ``/``)."""
    url = environ.get("PIP_INDEX_URL", "").strip()
    if not url:
        url = _pip_config_index() or PYPI
    return url.rstrip("/") + "/"


def _pip_config_index():
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.endswith(".index-url"):
            found[key.rsplit(".", 1)[0]] = value.strip().strip("'\"")
    for section in ("download", "global"):
        if found.get(section):
            return found[section]
    return None


def _version_of(filename, project):
    """Version part of a wheel or sdist file name of ``project`` (None when it is not one of its files)."""
    stem = normalize(project).replace("-", "_")
    base = filename
    if base.endswith(".whl"):
        parts = base[:-4].split("-")
        return parts[1] if len(parts) >= 5 and normalize(parts[0]) == normalize(stem) else None
    for ext in (".tar.gz", ".zip", ".tar.bz2"):
        if base.endswith(ext):
            name, _, version = base[: -len(ext)].rpartition("-")
            return version if normalize(name) == normalize(stem) else None
    return None


def _same_version(a, b):
    try:
        from packaging.version import Version

        return Version(a) == Version(b)
    except Exception:
        return a == b


def files(project, index=None, timeout=60, deadline=None):
    """The index's file entries (PEP 691 dicts: filename, url, hashes, ...) of ``project``; ``deadline``
    (:class:`Deadline`) bounds the whole request."""
    base = index or index_url()
    url = urllib.parse.urljoin(base, normalize(project) + "/")
    req = urllib.request.Request(url, headers={"Accept": ACCEPT})
    chunks = []
    try:
        with urllib.request.urlopen(req, timeout=deadline.remaining(timeout) if deadline else timeout) as resp:
            ctype = resp.headers.get("Content-Type", "")
            _read_all(resp, deadline, chunks.append)
        body = b"".join(chunks)
    except FetchTimeout:
        raise
    except OSError as exc:
        if deadline is not None and _timed_out(exc, deadline):
            raise deadline.expired() from None
        raise IndexLookupError(f"cannot read {url}: {exc}") from None
    if ACCEPT not in ctype:
        raise IndexLookupError(f"{url} does not speak PEP 691 JSON (Content-Type {ctype!r})")
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise IndexLookupError(f"{url}: invalid JSON ({exc})") from None
    out = []
    for f in data.get("files", []):
        f = dict(f)
        f["url"] = urllib.parse.urljoin(url, f.get("url", ""))
        out.append(f)
    return out


def _timed_out(exc, deadline):
    """Whether ``exc`` is a socket timeout that ran into ``deadline`` (then it is the deadline's failure)."""
    import socket

    reason = getattr(exc, "reason", exc)
    if not isinstance(reason, (socket.timeout, TimeoutError)):
        return False
    try:
        deadline.remaining()
    except FetchTimeout:
        return True
    return False


def latest(project, index=None, deadline=None):
    """``(newest release, newest final release)`` of ``project`` on the index (either may be None).

    Releases are the versions of the files the index lists (PEP 691) that are not yanked, read from the file
    names; dev releases count as pre-releases, and a version that is not PEP 440 is ignored, as pip does.
    """
    from packaging.version import InvalidVersion, Version

    found = set()
    for f in files(project, index, deadline=deadline):
        text = None if f.get("yanked") else _version_of(f.get("filename", ""), project)
        try:
            if text:
                found.add(Version(text))
        except InvalidVersion:
            continue
    if not found:
        return None, None
    finals = [v for v in found if not v.is_prerelease and not v.is_devrelease]
    return str(max(found)), (str(max(finals)) if finals else None)


def pick(entries, project, version, kind="sdist"):
    """The entry of ``project==version`` of ``kind`` ("sdist", or "wheel": a pure wheel first, then any)."""
    mine = [f for f in entries if not f.get("yanked") and _same_version(_version_of(f["filename"], project) or "",
                                                                         version)]
    if kind == "sdist":
        mine = [f for f in mine if not f["filename"].endswith(".whl")]
    else:
        mine = [f for f in mine if f["filename"].endswith(".whl")]
        mine.sort(key=lambda f: (not f["filename"].endswith("-none-any.whl"),
                                 f"cp{sys.version_info[0]}{sys.version_info[1]}" not in f["filename"],
                                 "x86_64" not in f["filename"]))
    return mine[0] if mine else None


def download(project, version, dest, kind="sdist", index=None, timeout=600, deadline=None):
    """Download the ``kind`` file of ``project==version`` into directory ``dest``; returns its path.

    The sha256 the index publishes is checked; the file appears under its final name only when complete.
    ``deadline`` (:class:`Deadline`) bounds the look-up and the download together.
    """
    entry = pick(files(project, index, deadline=deadline), project, version, kind)
    if entry is None:
        raise IndexLookupError(f"{index or index_url()} has no {kind} of {project}=={version}")
    os.makedirs(dest, exist_ok=True)
    path = os.path.join(dest, entry["filename"])
    want = (entry.get("hashes") or {}).get("sha256")
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=".part-")
    def write(chunk):
        digest.update(chunk)
        out.write(chunk)

    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(
                entry["url"], timeout=deadline.remaining(timeout) if deadline else timeout) as resp:
            _read_all(resp, deadline, write)
        if want and digest.hexdigest() != want:
            raise IndexLookupError(f"{entry['url']}: sha256 {digest.hexdigest()} != {want} published by the index")
        shutil.move(tmp, path)
    except FetchTimeout:
        raise
    except OSError as exc:
        if deadline is not None and _timed_out(exc, deadline):
            raise deadline.expired() from None
        raise IndexLookupError(f"cannot download {entry['url']}: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
