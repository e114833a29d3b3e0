"""Proof in production: what each process of a serving instance actually patched.

Nothing here runs at start-up. The engine calls :func:`applied` after every successful application; the
first call in a process logs one INFO line (pid, role, patch states), and every call

* rewrites ``<state dir>/<pid>.json`` atomically (temp file + ``os.replace``: a reader never sees half a
  file, concurrent writers never share a file), removed again at interpreter exit (``atexit``);
* sets the Prometheus gauge ``omni_patches_applied{patch=...}`` (1 applied, 0 otherwise) in the default
  registry when ``prometheus_client`` is importable (registered at the first application, never imported
  at start-up), so it shows on vLLM's ``/metrics``.

State directory: ``$OMNI_PATCHES_STATE_DIR`` if set (give each serving instance its own), else
``$XDG_RUNTIME_DIR/omni-patches``, else ``<tempdir>/omni-patches-<uid>`` (mode 0700; a directory owned by
someone else is not written to). Records carry the process group and session, which group the processes
of one instance when several share the default directory.

Role: ``multiprocessing.current_process().name`` (vLLM names its engine core ``EngineCore`` /
``EngineCore_DP<n>`` and its workers ``VllmWorker-<rank>``), ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``
(torchrun, vLLM's external launcher, Ray workers) and the command line's first argument.
"""
import json
import os
import sys
import tempfile
import time

_written_pid = None  # pid whose record this process wrote (a forked child writes its own)
_logged_pid = None
_gauge = None
_at_fork_registered = False
_atexit_registered = False


class _Token:
    registered = False


_FORK_TOKEN = _Token()


def state_dir(environ=os.environ):
    explicit = environ.get("OMNI_PATCHES_STATE_DIR", "").strip()
    if explicit:
        return explicit
    runtime = environ.get("XDG_RUNTIME_DIR", "").strip()
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "omni-patches")
    return os.path.join(tempfile.gettempdir(), f"omni-patches-{os.getuid()}")


def role(environ=os.environ):
    """What this process is, as far as it can tell without importing anything."""
    out = {}
    mp = sys.modules.get("multiprocessing")
    name = None
    if mp is not None:
        try:
            name = mp.current_process().name
        except Exception:
            name = None
    out["process_name"] = name
    if name and name.startswith(("EngineCore", "DPEngineCore")):
        label = "engine core"
    elif name and name.startswith(("VllmWorker", "Worker")):
        label = f"worker {name.rpartition('-')[2] if '-' in name else name}"
    elif environ.get("RANK") is not None:
        label = f"rank {environ.get('RANK')}"
    elif name and name != "MainProcess":
        label = name
    else:
        label = "main"
    out["role"] = label
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        if environ.get(key) is not None:
            out[key.lower()] = environ.get(key)
    out["argv0"] = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return out


def _snapshot(state):
    """``{patch id: {"state", "reason", "targets"}}`` without the engine lock (a forked child may not get it)."""
    patches = {}
    for pid, rt in list(state.runtime.items()):
        patches[pid] = {"state": rt.state, "reason": rt.reason, "targets": list(rt.applied_targets)}
    return patches


def _start_time(pid):
    """Kernel start time of ``pid`` (Linux), so a reused pid is not taken for the recorded process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def record(state):
    pid = os.getpid()
    try:
        pgid, sid = os.getpgid(0), os.getsid(0)
    except OSError:  # pragma: no cover
        pgid = sid = None
    from . import __version__

    return {"pid": pid, "ppid": os.getppid(), "pgid": pgid, "sid": sid, "start": _start_time(pid), "updated": time.time(),
            "omni_patches": __version__, "python": sys.executable, **role(), "patches": _snapshot(state)}


def _own_dir(path):
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() and not os.environ.get("OMNI_PATCHES_STATE_DIR"):
        raise PermissionError(f"{path} belongs to uid {st.st_uid}; set OMNI_PATCHES_STATE_DIR")
    return path


def write(rec, directory=None):
    directory = _own_dir(directory or state_dir())
    fd, tmp = tempfile.mkstemp(prefix=f".{rec['pid']}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(rec, fh)
        os.replace(tmp, os.path.join(directory, f"{rec['pid']}.json"))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _remove():
    if _written_pid != os.getpid():
        return  # inherited through fork: the parent's record is the parent's business
    try:
        os.unlink(os.path.join(state_dir(), f"{_written_pid}.json"))
    except OSError:
        pass


def _after_fork_in_child():
    """A forked child inherits the patched modules: record it as a process of its own."""
    global _written_pid
    state = _current_state()
    if state is None or _written_pid is None:
        return
    try:
        write(record(state))
        _written_pid = os.getpid()
    except Exception:
        _written_pid = None


def _current_state():
    engine = sys.modules.get("omni_patches.engine")
    return getattr(engine, "_state", None)


def applied(state, patch_id):
    """Called by the engine after each successful application. Never raises."""
    global _written_pid, _logged_pid, _at_fork_registered, _atexit_registered
    from . import log

    try:
        rec = record(state)
        if _logged_pid != rec["pid"]:
            _logged_pid = rec["pid"]
            states = ", ".join(f"{k}={v['state']}" for k, v in rec["patches"].items())
            log.get().info("process pid=%s role=%s patched by omni-patches %s: %s (state dir %s)", rec["pid"],
                           rec["role"], rec["omni_patches"], states, state_dir())
        try:
            write(rec)
            _written_pid = rec["pid"]
            if not _atexit_registered:
                import atexit

                atexit.register(_remove)
                _atexit_registered = True
            if not _at_fork_registered and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
                _at_fork_registered = True
            mp = sys.modules.get("multiprocessing")
            if mp is not None and not getattr(_FORK_TOKEN, "registered", False):
                # A multiprocessing fork child knows its name (VllmWorker-N) only in Process._bootstrap,
                # after os-level fork hooks ran: record it again from there.
                import multiprocessing.util

                multiprocessing.util.register_after_fork(_FORK_TOKEN, lambda _tok: _after_fork_in_child())
                _FORK_TOKEN.registered = True
        except OSError as exc:
            log.once(30, ("proof", "write"), "cannot record this process in %s (%s); `omni-patches status "
                     "--all-processes` will not list it", state_dir(), exc)
        _update_gauge(rec["patches"])
    except Exception:
        log.once(30, ("proof", "error"), "could not record what omni-patches applied", exc_info=True)


def _update_gauge(patches):
    global _gauge
    pc = sys.modules.get("prometheus_client")
    if pc is None:
        import importlib.util

        if importlib.util.find_spec("prometheus_client") is None:
            return
        import prometheus_client as pc
    if _gauge is None or _gauge[0] is not pc.REGISTRY:
        gauge = _register(pc)
        if gauge is None:
            return
        _gauge = (pc.REGISTRY, gauge)
    for pid, info in patches.items():
        _gauge[1].labels(patch=pid).set(1 if info["state"] == "applied" else 0)


def _register(pc):
    name, doc = "omni_patches_applied", "1 if the omni-patches patch is applied in this process, else 0"
    existing = getattr(pc.REGISTRY, "_names_to_collectors", {}).get(name)
    if existing is not None:
        return existing
    for kw in ({"multiprocess_mode": "livemax"}, {}):  # livemax: aggregated over live processes when
        try:                                          # PROMETHEUS_MULTIPROC_DIR is set (vLLM multi-API-server)
            return pc.Gauge(name, doc, ["patch"], **kw)
        except (ValueError, TypeError):
            continue
    return None


# -- reader (``omni-patches status --all-processes``) ---------------------------------------------------
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True


def collect(directory=None):
    """Every record in the state directory, each with ``alive`` set; unreadable files are reported, not fatal."""
    directory = directory or state_dir()
    out = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as fh:
                rec = json.load(fh)
        except FileNotFoundError:
            continue  # its process exited while we listed
        except (OSError, ValueError) as exc:
            out.append({"file": path, "error": str(exc), "alive": False, "status": "unreadable"})
            continue
        rec["file"] = path
        pid = rec.get("pid")
        rec["alive"] = isinstance(pid, int) and alive(pid)
        if rec["alive"] and rec.get("start") is not None and _start_time(pid) not in (None, rec["start"]):
            rec["alive"] = False  # the pid was reused by another process
        rec["status"] = "running" if rec["alive"] else "gone"
        out.append(rec)
    return sorted(out, key=lambda r: (r.get("pgid") or 0, r.get("pid") or 0))
