"""Proof in production: what each process of a serving instance actually patched.

Nothing here runs at interpreter start-up. At the first vLLM-family import the engine calls
:func:`ensure_instance` (the serving-instance id, see below); after every successful application it calls
:func:`applied`. The first application in a process logs one INFO line (pid, role, patch states), and every
application

* rewrites ``<state dir>/<pid>.json`` atomically (temp file + ``os.replace``: a reader never sees half a
  file, concurrent writers never share a file), removed again at exit: ``atexit``, and multiprocessing's own
  exit finalizers for fork and forkserver children (they end in ``os._exit`` after ``Process._bootstrap``,
  which skips ``atexit``);
* inside a Ray process (``ray`` already imported and connected; ray is never imported here), also puts the
  record into the cluster's own key-value store (GCS internal KV, namespace :data:`KV_NAMESPACE`, key
  ``<instance>/<node id>/<pid>``), so ``omni-patches status --all-processes --ray`` sees every node;
* sets the Prometheus gauge ``omni_patches_applied{patch=...}`` (1 applied, 0 otherwise) in the default
  registry when ``prometheus_client`` is importable (registered at the first application, never imported
  at start-up), so it shows on vLLM's ``/metrics``.

Instance: ``OMNI_PATCHES_INSTANCE``. The first process that starts the shim (first vLLM-family import) sets
it when unset, in ``os.environ``: every child inherits it, and vLLM's Ray executors carry it to their
workers (the V2 executor copies the driver's environment, the legacy one the ``OMNI_PATCHES`` prefix).
Every record carries it, so records of one serving instance can be told from another's.

The engine also calls :func:`started` once its gates decided, so a process where nothing applies is listed
too, and vLLM's plugin entry point calls :func:`inactive_here` in a process of a serving instance (one that
inherited ``OMNI_PATCHES_INSTANCE``) where the shim stays off, so the view lists it with the reason.

State directory: ``$OMNI_PATCHES_STATE_DIR`` if set (give each serving instance its own), else
``$XDG_RUNTIME_DIR/omni-patches``, else ``<tempdir>/omni-patches-<uid>`` (mode 0700; a directory owned by
someone else is not written to). A relative ``OMNI_PATCHES_STATE_DIR`` is made absolute once, at the first
record, and put back into ``os.environ``: a later ``os.chdir`` of the host, and the children it starts, use
the same directory.

Role: ``ray worker <rank>`` in a Ray worker process (``default_worker.py``, or Ray's worker mode), with
vLLM's rank read from ``vllm.distributed.parallel_state`` when it is initialised; otherwise
``multiprocessing.current_process().name`` (vLLM names its engine core ``EngineCore`` / ``EngineCore_DP<n>``
and its workers ``VllmWorker-<rank>``), ``RANK`` (torchrun, vLLM's external launcher), else ``main``.

Reading (``omni-patches status --all-processes``): :func:`collect` (state directory) and :func:`collect_ray`
(cluster KV store, imports ray), :func:`visible` (hides ghosts), :func:`prune` / :func:`prune_ray`.
"""
import os
import sys
import time

INSTANCE = "OMNI_PATCHES_INSTANCE"
KV_NAMESPACE = "omni_patches"

_written_pid = None  # pid whose record this process wrote (a forked child writes its own)
_written_file = None  # where it went: removed from there at exit, whatever the cwd or the environment by then
_mp_finalizer = None  # multiprocessing exit finalizer of this process (fork / forkserver children)
_published_key = None  # (pid, KV key) this process put into Ray's KV store
_logged_pid = None
_gauge = None
_at_fork_registered = False
_atexit_registered = False


class _Token:
    registered = False


_FORK_TOKEN = _Token()


def ensure_instance(environ=None):
    """The serving-instance id: ``OMNI_PATCHES_INSTANCE``, set here (random hex) when unset. Never raises."""
    environ = os.environ if environ is None else environ
    try:
        value = (environ.get(INSTANCE) or "").strip()
        if not value:
            value = os.urandom(6).hex()
            environ[INSTANCE] = value
        return value
    except Exception:  # pragma: no cover - an odd os.environ must not stop the shim
        return None


STATE_DIR = "OMNI_PATCHES_STATE_DIR"


def state_dir(environ=os.environ):
    explicit = environ.get(STATE_DIR, "").strip()
    if explicit:
        return explicit
    runtime = environ.get("XDG_RUNTIME_DIR", "").strip()
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "omni-patches")
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"omni-patches-{os.getuid()}")


def _writer_dir():
    """The directory this process records into. A relative ``OMNI_PATCHES_STATE_DIR`` is resolved against the
    working directory once, here, and put back into ``os.environ`` absolute: the host may ``os.chdir`` later
    (its record must still be found and removed), and the children it starts must use the same directory."""
    raw = os.environ.get(STATE_DIR, "").strip()
    if raw and not os.path.isabs(raw):
        absolute = os.path.abspath(raw)
        try:
            os.environ[STATE_DIR] = absolute
        except Exception:  # pragma: no cover - an odd os.environ: the absolute path still serves this process
            pass
        return absolute
    return os.path.abspath(state_dir())


# -- who is this process ------------------------------------------------------------------------------
def _ray_worker_module():
    """``ray._private.worker`` if ray is imported in this process (never imports it)."""
    if "ray" not in sys.modules:
        return None
    return sys.modules.get("ray._private.worker")


def ray_info():
    """Ray identity of this process (node, job, actor, ...) or None when not connected to a Ray cluster."""
    worker_mod = _ray_worker_module()
    gw = getattr(worker_mod, "global_worker", None)
    if gw is None or not getattr(gw, "connected", False):
        return None
    out = {"worker_mode": getattr(gw, "mode", None) == getattr(worker_mod, "WORKER_MODE", 1)}
    try:
        ctx = sys.modules["ray"].get_runtime_context()
    except Exception:
        return out
    for key, getter in (("node_id", "get_node_id"), ("job_id", "get_job_id"), ("actor_id", "get_actor_id"),
                        ("worker_id", "get_worker_id")):
        try:
            out[key] = getattr(ctx, getter)()
        except Exception:
            out[key] = None
    out["node_ip"] = getattr(gw, "node_ip_address", None)
    return out


def is_ray_worker(environ=os.environ, info=None):
    """A Ray worker process (task or actor), as far as can be told without importing ray."""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if argv0 == "default_worker.py":
        return True
    if info is not None and info.get("worker_mode"):
        return True
    # Set by the raylet for the workers it starts (a driver started by hand does not have it).
    return "ray" in sys.modules and bool(environ.get("RAY_RAYLET_PID")) and not environ.get("RAY_JOB_ENTRYPOINT")


def vllm_rank():
    """``{"rank", "local_rank", "world_size", "tp_rank"}`` from vLLM's initialised parallel state, else {}."""
    ps = sys.modules.get("vllm.distributed.parallel_state")
    world = getattr(ps, "_WORLD", None)
    if world is None:
        return {}
    out = {}
    for key, attr in (("rank", "rank"), ("local_rank", "local_rank"), ("world_size", "world_size")):
        value = getattr(world, attr, None)
        if isinstance(value, int):
            out[key] = value
    tp = getattr(ps, "_TP", None)
    if isinstance(getattr(tp, "rank_in_group", None), int):
        out["tp_rank"] = tp.rank_in_group
    # The instance's parallel layout, so the reader can tell how many workers to expect (absent groups: unknown).
    for key, attr in (("tp_size", "_TP"), ("pp_size", "_PP"), ("dp_size", "_DP")):
        size = getattr(getattr(ps, attr, None), "world_size", None)
        if isinstance(size, int):
            out[key] = size
    return out


def role(environ=os.environ, info=None):
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
    ranks = vllm_rank()
    if is_ray_worker(environ, info):
        label = "ray worker" + (f" {ranks['rank']}" if "rank" in ranks else "")
    elif name and name.startswith(("EngineCore", "DPEngineCore")):
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
    out.update({k: str(v) for k, v in ranks.items()})  # vLLM's own view wins over the launcher's variables
    out["argv0"] = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return out


def _snapshot(state):
    """``{patch id: {"state", "reason", "targets"}}`` without the engine lock (a forked child may not get it)."""
    patches = {}
    for pid, rt in list(state.runtime.items()):
        patches[pid] = {"state": rt.state, "reason": rt.full_reason(), "targets": list(rt.applied_targets)}
    return patches


def _proc_stat(pid):
    """``(state letter, kernel start time in clock ticks after boot)`` of ``pid`` (Linux), else (None, None)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None, None


def _start_time(pid):
    """Kernel start time of ``pid`` in clock ticks after boot (Linux), so a reused pid is not taken for the
    recorded process."""
    return _proc_stat(pid)[1]


_BOOT = {}


def _boot(key):
    """``boot_id`` (which boot of which machine) and ``btime`` (boot wall time), read once."""
    if not _BOOT:
        try:
            with open("/proc/sys/kernel/random/boot_id") as fh:
                _BOOT["boot_id"] = fh.read().strip()
        except OSError:
            _BOOT["boot_id"] = None
        try:
            with open("/proc/stat") as fh:
                _BOOT["btime"] = next((int(ln.split()[1]) for ln in fh if ln.startswith("btime ")), None)
        except (OSError, ValueError):
            _BOOT["btime"] = None
    return _BOOT.get(key)


def _started_at(ticks):
    """Wall-clock start of a process from its kernel start time (None when unknown)."""
    btime = _boot("btime")
    if ticks is None or btime is None:
        return None
    try:
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):  # pragma: no cover
        return None


def record(state):
    pid = os.getpid()
    try:
        pgid, sid = os.getpgid(0), os.getsid(0)
    except OSError:  # pragma: no cover
        pgid = sid = None
    from . import __version__

    start = _start_time(pid)
    info = ray_info()
    rec = {"pid": pid, "ppid": os.getppid(), "pgid": pgid, "sid": sid, "start": start,
           "started": _started_at(start), "updated": time.time(), "host": os.uname().nodename,
           "boot_id": _boot("boot_id"), "instance": os.environ.get(INSTANCE), "omni_patches": __version__,
           "python": sys.executable, **role(info=info), "patches": _snapshot(state)}
    if info is not None:
        rec["ray"] = {k: v for k, v in info.items() if k != "worker_mode"}
    return rec


def _own_dir(path):
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() and not os.environ.get("OMNI_PATCHES_STATE_DIR"):
        raise PermissionError(f"{path} belongs to uid {st.st_uid}; set OMNI_PATCHES_STATE_DIR")
    return path


def write(rec, directory=None):
    """Write ``rec`` atomically; returns the file. A writer killed mid-way leaves only ``.<pid>.*.tmp``,
    which ``prune`` removes once that pid is dead."""
    import json
    import tempfile

    directory = _own_dir(directory or _writer_dir())
    fd, tmp = tempfile.mkstemp(prefix=f".{rec['pid']}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(rec, fh)
        path = os.path.join(directory, f"{rec['pid']}.json")
        os.replace(tmp, path)
        return path
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- Ray's key-value store -------------------------------------------------------------------------------
def kv_key(rec):
    node = (rec.get("ray") or {}).get("node_id") or rec.get("host") or "-"
    return f"{rec.get('instance') or '-'}/{node}/{rec.get('pid')}"


def _internal_kv():
    """Ray's internal KV module when this process is connected to a cluster; never imports ray itself."""
    if _ray_worker_module() is None:
        return None
    kv = sys.modules.get("ray.experimental.internal_kv")
    if kv is None:
        import importlib

        kv = importlib.import_module("ray.experimental.internal_kv")  # ray is loaded: a light submodule
    return kv if kv._internal_kv_initialized() else None


def publish(rec):
    """Put ``rec`` into the cluster's KV store when this process is a connected Ray process. True if done."""
    global _published_key
    if rec.get("ray") is None:
        return False
    kv = _internal_kv()
    if kv is None:
        return False
    import json

    key = kv_key(rec)
    kv._internal_kv_put(key, json.dumps(rec), overwrite=True, namespace=KV_NAMESPACE)
    _published_key = (rec["pid"], key)
    return True


def _unpublish():
    if _published_key is None or _published_key[0] != os.getpid():
        return
    try:
        kv = _internal_kv()
        if kv is not None:
            kv._internal_kv_del(_published_key[1], namespace=KV_NAMESPACE)
    except Exception:
        pass


def _remove():
    if _written_pid != os.getpid():
        return  # inherited through fork: the parent's record is the parent's business
    _unpublish()
    try:
        os.unlink(_written_file or os.path.join(_writer_dir(), f"{_written_pid}.json"))
    except OSError:
        pass


def _remove_at_mp_exit():
    """Also remove the record from multiprocessing's exit finalizers: a fork or forkserver child ends with
    ``os._exit`` after ``Process._bootstrap`` (atexit never runs there), but its finalizers do run. Once per
    process (``_bootstrap`` clears the registry a forked child inherits before its after-fork hooks run)."""
    global _mp_finalizer
    util = sys.modules.get("multiprocessing.util")
    if util is None:
        return
    if _mp_finalizer is not None and _mp_finalizer._pid == os.getpid() and _mp_finalizer.still_active():
        return
    _mp_finalizer = util.Finalize(None, _remove, exitpriority=-1)  # after the children were joined


def _after_fork_in_child():
    """A forked child inherits the patched modules: record it as a process of its own."""
    global _written_pid, _written_file
    state = _current_state()
    if state is None or _written_pid is None:
        return
    try:
        _written_file = write(_inactive_record() if state is _INACTIVE else record(state))
        _written_pid = os.getpid()
        _remove_at_mp_exit()
    except Exception:
        _written_pid = None


class _Inactive:
    """Stands for the engine state in a process recorded as inactive (see :func:`inactive_here`)."""


_INACTIVE = _Inactive()
_inactive_reason = None


def _current_state():
    engine = sys.modules.get("omni_patches.engine")
    state = getattr(engine, "_state", None)
    if state is None and _inactive_reason is not None:
        return _INACTIVE
    return state


def refresh():
    """Record this process again (e.g. once vLLM's rank is known). Cheap when nothing applied; never raises."""
    global _written_file
    state = _current_state()
    if state is None or state is _INACTIVE or _written_pid != os.getpid():
        return False
    try:
        rec = record(state)
        _written_file = write(rec)
        _publish_quietly(rec)
        return True
    except Exception:
        return False


def _publish_quietly(rec):
    from . import log

    try:
        publish(rec)
    except Exception as exc:
        log.once(30, ("proof", "ray"), "cannot publish this process's record to the Ray cluster (%s: %s); "
                 "`omni-patches status --all-processes --ray` will not list it", type(exc).__name__, exc)


def applied(state, patch_id):
    """Called by the engine after each successful application. Never raises."""
    global _logged_pid
    from . import log

    try:
        rec = record(state)
        if _logged_pid != rec["pid"]:
            _logged_pid = rec["pid"]
            states = ", ".join(f"{k}={v['state']}" for k, v in rec["patches"].items())
            log.get().info("process pid=%s role=%s instance=%s patched by omni-patches %s: %s (state dir %s)",
                           rec["pid"], rec["role"], rec["instance"], rec["omni_patches"], states, _writer_dir())
        _keep(rec)
        _update_gauge(rec["patches"])
    except Exception:
        log.once(30, ("proof", "error"), "could not record what omni-patches applied", exc_info=True)


def started(state):
    """Called by the engine once its gates decided (the first vLLM-family import): record this process even
    when no patch applies in it (a driver, a worker where everything is skipped), so ``status --all-processes``
    lists every process of the instance the shim runs in. Never raises."""
    from . import log

    if _written_pid == os.getpid():
        return
    try:
        _keep(record(state))
    except Exception:
        log.once(30, ("proof", "error"), "could not record this process", exc_info=True)


def _inactive_record():
    from . import __version__

    pid = os.getpid()
    start = _start_time(pid)
    info = ray_info()
    rec = {"pid": pid, "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "start": start,
           "started": _started_at(start), "updated": time.time(), "host": os.uname().nodename,
           "boot_id": _boot("boot_id"), "instance": os.environ.get(INSTANCE), "omni_patches": __version__,
           "python": sys.executable, **role(info=info), "inactive": _inactive_reason, "patches": {}}
    if info is not None:
        rec["ray"] = {k: v for k, v in info.items() if k != "worker_mode"}
    return rec


def inactive_here():
    """vLLM's plugin entry point calls this after its activation attempt. In a process of a serving instance
    (``OMNI_PATCHES_INSTANCE`` inherited from a process where the shim ran) where the shim stays off (the
    node's own ``OMNI_PATCHES=0``, a value that is no switch), record the process as inactive, with the reason:
    the instance view must show the rank that runs unpatched. Anywhere else nothing happens. Never raises."""
    global _inactive_reason
    try:
        if not (os.environ.get(INSTANCE) or "").strip() or _written_pid == os.getpid():
            return False
        from . import engine

        if engine.is_active():
            return False  # recorded by started() / applied()
        _inactive_reason = engine.inactive_reason()
        _keep(_inactive_record())
        return True
    except Exception:
        return False


def _keep(rec):
    """Publish ``rec`` (Ray), write it, and register what removes it at exit and records forked children."""
    global _written_pid, _written_file, _at_fork_registered, _atexit_registered
    from . import log

    _publish_quietly(rec)
    try:
        _written_file = write(rec)
        _written_pid = rec["pid"]
        _remove_at_mp_exit()
        if not _atexit_registered:
            import atexit

            atexit.register(_remove)
            _atexit_registered = True
        if not _at_fork_registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _at_fork_registered = True
        mp = sys.modules.get("multiprocessing")
        if mp is not None:
            # A multiprocessing fork child knows its name (VllmWorker-N) only in Process._bootstrap,
            # after os-level fork hooks ran: record it again from there (and register its exit finalizer).
            import multiprocessing.util as util

            if _FORK_TOKEN.registered is not util:  # once per module (a reloaded one has a new registry)
                util.register_after_fork(_FORK_TOKEN, lambda _tok: _after_fork_in_child())
                _FORK_TOKEN.registered = util
    except OSError as exc:
        log.once(30, ("proof", "write"), "cannot record this process in %s (%s); `omni-patches status "
                 "--all-processes` will not list it", _writer_dir(), exc)


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


def _local_alive(rec):
    """Whether the recorded process still runs, judged on this machine (only valid on the same boot)."""
    pid = rec.get("pid")
    if not (isinstance(pid, int) and pid > 0 and alive(pid)):
        return False
    state, start = _proc_stat(pid)
    if state in ("Z", "X", "x"):
        return False  # dead, not yet reaped by its parent (a killed worker whose parent has not joined it)
    if rec.get("start") is not None and start not in (None, rec["start"]):
        return False  # the pid was reused by another process
    return True


def _status(is_alive):
    return {True: "running", False: "gone", None: "unknown"}[is_alive]


_NUMBERS = ("pid", "ppid", "pgid", "sid", "start", "started", "updated")
_TEXTS = ("instance", "role", "process_name", "host", "boot_id", "node_ip")


def _check(rec):
    """Why ``rec`` (parsed JSON) is not an omni-patches record, or None. The readers rely on these types."""
    if not isinstance(rec, dict):
        return f"not an omni-patches record (a JSON {type(rec).__name__})"
    if not isinstance(rec.get("pid"), int) or isinstance(rec.get("pid"), bool):
        return "not an omni-patches record (no integer pid)"
    for key in _NUMBERS:
        value = rec.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"not an omni-patches record ({key!r} is a {type(value).__name__}, not a number)"
    for key in _TEXTS:
        if rec.get(key) is not None and not isinstance(rec[key], str):
            return f"not an omni-patches record ({key!r} is a {type(rec[key]).__name__}, not a string)"
    patches = rec.get("patches", {})
    if not isinstance(patches, dict) or not all(isinstance(v, dict) for v in patches.values()):
        return "not an omni-patches record ('patches' is not a mapping of patch id to state)"
    if any(not isinstance(v.get("state", ""), str) for v in patches.values()):
        return "not an omni-patches record (a patch state is not a string)"
    ray = rec.get("ray")
    if ray is not None and not (isinstance(ray, dict) and all(v is None or isinstance(v, str) for v in ray.values())):
        return "not an omni-patches record ('ray' is not a mapping of names to strings)"
    return None


def collect(directory=None, problems=None):
    """Every record in the state directory, each with ``alive`` set. Files that are no record (unparsable,
    foreign JSON, unreadable) come back as ``unreadable`` entries; a directory that cannot be listed (a file,
    another user's 0700 directory) adds a line to ``problems``. Never raises over what it reads."""
    import json

    directory = directory or state_dir()
    out = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    except OSError as exc:
        if problems is not None:
            problems.append(f"cannot read the state directory {directory}: {exc.strerror or exc}")
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
        error = _check(rec)
        if error:
            out.append({"file": path, "error": error, "alive": False, "status": "unreadable"})
            continue
        rec["file"] = path
        rec["source"] = "local"
        rec["alive"] = _local_alive(rec)
        if rec.get("boot_id") and _boot("boot_id") and rec["boot_id"] != _boot("boot_id"):
            # Written on another boot: of this machine (its process died with that boot), or of another machine
            # sharing the directory (its pid says nothing here).
            rec["alive"] = False if rec.get("host") == os.uname().nodename else None
        rec["status"] = _status(rec["alive"])
        out.append(rec)
    return sorted(out, key=lambda r: (r.get("pgid") or 0, r.get("pid") or 0))


def visible(records, show_all=False):
    """Hide ghosts: records of dead processes older than the live ones of their instance.

    A dead record is hidden when a live process of the same instance started after it was last written (it
    was replaced: a restarted worker, a respawned engine), or when its instance has no live process left and
    a live process of another instance started after it (a finished predecessor). A process that died while
    its instance still runs is shown (as ``gone``): that is news. ``show_all`` shows everything.
    """
    if show_all:
        return list(records)
    live_starts = {}
    for r in records:
        if r.get("status") in ("running", "unknown"):
            live_starts.setdefault(r.get("instance"), []).append(r.get("started") or r.get("updated") or 0)
    every_live = [t for ts in live_starts.values() for t in ts]
    out = []
    for r in records:
        if r.get("status") == "gone":
            mine = live_starts.get(r.get("instance"))
            newer = mine if mine else every_live
            if any(t > (r.get("updated") or 0) for t in newer):
                continue
        out.append(r)
    return out


def leftovers(directory=None):
    """Temp files of writers that died mid-write (``.<pid>.*.tmp`` whose pid is dead, a zombie, or now a later
    process that reused the pid): nothing else ever removes them."""
    directory = directory or state_dir()
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not (name.startswith(".") and name.endswith(".tmp")):
            continue
        pid = name[1:].partition(".")[0]
        if not pid.isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue  # renamed into place (or removed) while we listed
        started = _started_at(_proc_stat(int(pid))[1])
        if not _local_alive({"pid": int(pid)}) or (started is not None and started > mtime + 1):
            out.append(path)
    return out


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def instances(records):
    """Per instance: the worker count vLLM's parallel layout expects (its world size, recorded by the workers
    once their parallel state is initialised) next to the ranks found running, and the ranks missing."""
    out = {}
    for r in records:
        if "error" in r:
            continue
        info = out.setdefault(r.get("instance") or "-", {"processes": 0, "expected_workers": None, "ranks": set()})
        info["processes"] += 1
        size = _int(r.get("world_size"))
        if size is not None and size > 0 and (info["expected_workers"] or 0) < size:
            info["expected_workers"] = size
            for key in ("tp_size", "pp_size", "dp_size"):
                info[key] = _int(r.get(key))
        rank = _int(r.get("rank"))
        if rank is not None and r.get("status") in ("running", "unknown"):
            info["ranks"].add(rank)
    for info in out.values():
        ranks = info.pop("ranks")
        info["workers_found"] = len(ranks)
        expected = info["expected_workers"]
        info["missing_ranks"] = sorted(set(range(expected)) - ranks) if expected else []
    return out


PRUNED = ".pruned"  # in the state directory: when --prune last ran and what it removed (the empty view says so)


def prune(directory=None, problems=None):
    """Remove the records of dead processes, and the temp files of writers killed mid-write, from the state
    directory. Records that are no omni-patches record are left alone (reported by ``collect``). Returns the
    files removed; what could not be read or removed goes to ``problems``."""
    import json

    directory = directory or state_dir()
    removed = []
    stale = [rec["file"] for rec in collect(directory, problems) if rec.get("status") == "gone"]
    for path in stale + leftovers(directory):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if problems is not None:
                problems.append(f"cannot remove {path}: {exc.strerror or exc}")
    if removed:
        try:
            with open(os.path.join(directory, PRUNED), "w") as fh:
                json.dump({"time": time.time(), "removed": len(removed)}, fh)
        except OSError:
            pass
    return removed


def last_prune(directory=None):
    """``{"time", "removed"}`` of the last prune that removed something here, else None."""
    import json

    try:
        with open(os.path.join(directory or state_dir(), PRUNED)) as fh:
            got = json.load(fh)
        return got if isinstance(got, dict) and isinstance(got.get("time"), (int, float)) else None
    except (OSError, ValueError):
        return None


# -- Ray cluster reader (imports ray: only for ``status --ray``) --------------------------------------------
class RayUnavailable(RuntimeError):
    """ray is not importable here, or the cluster cannot be reached."""


def ray_address(address=None, environ=os.environ):
    """The address ``--ray`` connects to: the argument, else ``RAY_ADDRESS``, else ``auto``."""
    return address or environ.get("RAY_ADDRESS", "").strip() or "auto"


class _Cluster:
    """The few GCS calls the reader needs, over Ray's own GCS client: no driver is registered, and an explicit
    address is used as given (Ray's address helpers would swap 127.0.0.1 for the machine's interface address)."""

    def __init__(self, address):
        try:
            import ray  # noqa: F401
            from ray._private import services
            from ray._raylet import GcsClient
        except ImportError as exc:
            raise RayUnavailable(f"ray is not importable here ({exc}); run this where ray is installed") from exc
        try:
            if address == "auto":  # RAY_ADDRESS, else the cluster this host started last
                address = services.get_ray_address_from_environment("auto", None)
            self.address = address
            self.gcs = GcsClient(address=address)
        except Exception as exc:
            raise RayUnavailable(f"cannot reach the Ray cluster at {address!r}: {type(exc).__name__}: {exc}") from exc

    def keys(self):
        return self.gcs.internal_kv_keys(b"", namespace=KV_NAMESPACE.encode(), timeout=30)

    def get(self, keys):
        if not keys:
            return {}
        return self.gcs.internal_kv_multi_get(list(keys), namespace=KV_NAMESPACE.encode(), timeout=30)

    def delete(self, key):
        return self.gcs.internal_kv_del(key, False, namespace=KV_NAMESPACE.encode(), timeout=30)

    def nodes(self):
        """node id (hex) -> {"alive", "ip"}."""
        out = {}
        for node_id, info in self.gcs.get_all_node_info(timeout=30).items():
            key = node_id.hex() if hasattr(node_id, "hex") else str(node_id)
            out[key] = {"alive": info.state == 0, "ip": info.node_manager_address}  # GcsNodeInfo.ALIVE == 0
        return out

    def jobs(self):
        """job id (hex) -> finished?"""
        out = {}
        for job_id, info in self.gcs.get_all_job_info(timeout=30).items():
            key = job_id.hex() if hasattr(job_id, "hex") else str(job_id)
            out[key] = bool(info.is_dead)
        return out

    def actors(self):
        """actor id (hex) -> {"alive", "pid", "name"}; {} when this Ray cannot tell."""
        call = getattr(self.gcs, "async_get_all_actor_info", None)
        if call is None:
            return {}
        import asyncio

        async def get():
            return await call(timeout=30)

        out = {}
        try:
            table = asyncio.run(get())
        except Exception:
            return {}
        for actor_id, info in table.items():
            key = actor_id.hex() if hasattr(actor_id, "hex") else str(actor_id)
            out[key] = {"alive": info.state not in (4,), "pid": info.pid or None, "name": info.name}  # DEAD == 4
        return out


def _ray_alive(rec, nodes, jobs, actors):
    """running / gone / unknown for a record published by a Ray process, from the cluster's own tables."""
    info = rec.get("ray") or {}
    node = nodes.get(info.get("node_id") or "")
    if node is not None and not node["alive"]:
        return False
    if info.get("job_id") and jobs.get(info["job_id"]):
        return False  # its job finished: Ray ended the job's workers
    actor = actors.get(info.get("actor_id") or "")
    if actor is not None:
        if not actor["alive"]:
            return False
        if actor["pid"] and actor["pid"] != rec.get("pid"):
            return False  # the actor was restarted in another process
    if rec.get("boot_id") and rec.get("boot_id") == _boot("boot_id"):
        return _local_alive(rec)  # same machine: the kernel knows
    if actor is not None:
        return True
    return None


def collect_ray(address=None, cluster=None):
    """Every record in the cluster's KV store, each with ``status`` running / gone / unknown and its node."""
    import json

    cluster = cluster or _Cluster(ray_address(address))
    try:
        keys = list(cluster.keys())
        values = cluster.get(keys)
        nodes, jobs, actors = cluster.nodes(), cluster.jobs(), cluster.actors()
    except Exception as exc:
        raise RayUnavailable(f"reading the Ray cluster at {cluster.address} failed: {type(exc).__name__}: {exc}") \
            from exc
    out = []
    for key in keys:
        raw = values.get(key)
        if raw is None:
            continue  # deleted while we listed
        skey = key.decode() if isinstance(key, bytes) else str(key)
        try:
            rec = json.loads(raw)
            error = _check(rec)
        except ValueError as exc:
            error = str(exc)
        if error:
            out.append({"key": skey, "error": error, "alive": False, "status": "unreadable", "source": "ray"})
            continue
        rec["key"] = skey
        rec["source"] = "ray"
        info = rec.get("ray") or {}
        node = nodes.get(info.get("node_id") or "")
        rec["node_ip"] = info.get("node_ip") or (node or {}).get("ip")
        actor = actors.get(info.get("actor_id") or "")
        if actor is not None and actor.get("name"):
            rec["actor_name"] = actor["name"]
        rec["alive"] = _ray_alive(rec, nodes, jobs, actors)
        rec["status"] = _status(rec["alive"])
        out.append(rec)
    return sorted(out, key=lambda r: (r.get("instance") or "", r.get("node_ip") or "", _rank_key(r), r.get("pid") or 0))


def _rank_key(rec):
    try:
        return int(rec.get("rank"))
    except (TypeError, ValueError):
        return 1 << 30


def prune_ray(records, address=None, cluster=None):
    """Delete the KV entries of the ``gone`` records among ``records``. Returns the keys removed."""
    cluster = cluster or _Cluster(ray_address(address))
    removed = []
    for rec in records:
        if rec.get("source") == "ray" and rec.get("status") == "gone" and rec.get("key"):
            cluster.delete(rec["key"].encode())
            removed.append(rec["key"])
    return removed


def merge_local(ray_records, local_records):
    """The cluster's records plus this host's local ones that Ray does not hold: those of the same instances,
    and every live one (the driver / engine core records itself before it connects to Ray, and is the only
    process of its instance listed when no worker could record itself), and the files that are no record."""
    instances = {r.get("instance") for r in ray_records if r.get("instance")}
    seen = {(r.get("boot_id"), r.get("pid")) for r in ray_records}
    extra = [r for r in local_records if (r.get("boot_id"), r.get("pid")) not in seen
             and (r.get("instance") in instances or r.get("status") in ("running", "unknown", "unreadable"))]
    return ray_records + extra
