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


def files(project, index=None, timeout=60):
    """The index's file entries (PEP 691 dicts: filename, url, hashes, ...) of ``project``."""
    base = index or index_url()
    url = urllib.parse.urljoin(base, normalize(project) + "/")
    req = urllib.request.Request(url, headers={"Accept": ACCEPT})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            ctype = resp.headers.get("Content-Type", "")
            body = resp.read()
    except OSError as exc:
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


def download(project, version, dest, kind="sdist", index=None, timeout=600):
    """Download the ``kind`` file of ``project==version`` into directory ``dest``; returns its path.

    The sha256 the index publishes is checked; the file appears under its final name only when complete.
    """
    entry = pick(files(project, index), project, version, kind)
    if entry is None:
        raise IndexLookupError(f"{index or index_url()} has no {kind} of {project}=={version}")
    os.makedirs(dest, exist_ok=True)
    path = os.path.join(dest, entry["filename"])
    want = (entry.get("hashes") or {}).get("sha256")
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(entry["url"], timeout=timeout) as resp:
            while True:
                chunk = resp.read(1 << 20)
                if not chunk:
                    break
                digest.update(chunk)
                out.write(chunk)
        if want and digest.hexdigest() != want:
            raise IndexLookupError(f"{entry['url']}: sha256 {digest.hexdigest()} != {want} published by the index")
        shutil.move(tmp, path)
    except OSError as exc:
        raise IndexLookupError(f"cannot download {entry['url']}: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
