"""Proof in production: what each process of a serving instance actually patched.

Nothing here runs at interpreter start-up. At the first vLLM-family import the engine calls
:func:`ensure_instance` (the serving-instance id, see below) and :func:`attach` (where this module reads the
patches' records: it never imports the engine); after every successful application it calls :func:`applied`.
The first application in a process logs one INFO line (pid, role, patch states), and every application

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
too (and :func:`detach` when it is deactivated), and vLLM's plugin entry point calls :func:`inactive_here` in a
process of a serving instance (one that inherited ``OMNI_PATCHES_INSTANCE``) where the shim stays off, so the
view lists it with the reason.

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

from ._version import __version__
from .states import State

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


def writer_dir():
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


_runs = None  # the active engine's records: () -> {patch id: PatchRun} (attach); None while the shim is off here


def attach(runs):
    """The engine started here: ``runs()`` gives its live ``{patch id: PatchRun}`` from now on (passed down, so
    that this module never imports the engine)."""
    global _runs
    _runs = runs


def detach():
    """The engine was deactivated here: nothing more is recorded for it (a forked child included)."""
    global _runs
    _runs = None


def _patches():
    """``{patch id: {"state", "reason", "targets"}}`` without the engine lock (a forked child may not get it)."""
    runs = _runs
    return {pid: rt.view() for pid, rt in (runs() if runs is not None else {}).items()}


def proc_stat(pid):
    """``(state letter, kernel start time in clock ticks after boot)`` of ``pid`` (Linux), else (None, None)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None, None


def start_time(pid):
    """Kernel start time of ``pid`` in clock ticks after boot (Linux), so a reused pid is not taken for the
    recorded process."""
    return proc_stat(pid)[1]


_BOOT = {}


def boot(key):
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


def started_at(ticks):
    """Wall-clock start of a process from its kernel start time (None when unknown)."""
    btime = boot("btime")
    if ticks is None or btime is None:
        return None
    try:
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):  # pragma: no cover
        return None


def record():
    """This process's record: who it is (pid, start time, role, rank, Ray) and what each patch did in it."""
    pid = os.getpid()
    try:
        pgid, sid = os.getpgid(0), os.getsid(0)
    except OSError:  # pragma: no cover
        pgid = sid = None
    start = start_time(pid)
    info = ray_info()
    rec = {"pid": pid, "ppid": os.getppid(), "pgid": pgid, "sid": sid, "start": start,
           "started": started_at(start), "updated": time.time(), "host": os.uname().nodename,
           "boot_id": boot("boot_id"), "instance": os.environ.get(INSTANCE), "omni_patches": __version__,
           "python": sys.executable, **role(info=info), "patches": _patches()}
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

    directory = _own_dir(directory or writer_dir())
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


def internal_kv():
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
    kv = internal_kv()
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
        kv = internal_kv()
        if kv is not None:
            kv._internal_kv_del(_published_key[1], namespace=KV_NAMESPACE)
    except Exception:
        pass


def remove():
    if _written_pid != os.getpid():
        return  # inherited through fork: the parent's record is the parent's business
    _unpublish()
    try:
        os.unlink(_written_file or os.path.join(writer_dir(), f"{_written_pid}.json"))
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
    _mp_finalizer = util.Finalize(None, remove, exitpriority=-1)  # after the children were joined


def _after_fork_in_child():
    """A forked child inherits the patched modules: record it as a process of its own."""
    global _written_pid, _written_file
    state = _current_state()
    if state is None or _written_pid is None:
        return
    try:
        _written_file = write(_inactive_record() if state is _INACTIVE else record())
        _written_pid = os.getpid()
        _remove_at_mp_exit()
    except Exception:
        _written_pid = None


_ACTIVE, _INACTIVE = "active", "inactive"
_inactive_reason = None


def forget():
    """Forget that this process recorded anything (tests: each starts as a process that wrote nothing yet).
    The hooks registered at exit and fork stay: they act on what is recorded next."""
    global _written_pid, _written_file, _published_key, _logged_pid, _inactive_reason
    _written_pid = _written_file = _published_key = _logged_pid = _inactive_reason = None


def _current_state():
    """``_ACTIVE`` (the shim runs here), ``_INACTIVE`` (recorded as inactive, see :func:`inactive_here`) or None."""
    if _runs is not None:
        return _ACTIVE
    return _INACTIVE if _inactive_reason is not None else None


def refresh():
    """Record this process again (e.g. once vLLM's rank is known). Cheap when nothing applied; never raises."""
    global _written_file
    if _current_state() is not _ACTIVE or _written_pid != os.getpid():
        return False
    try:
        rec = record()
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


def applied(patch_id):
    """Called by the engine after each successful application. Never raises."""
    global _logged_pid
    from . import log

    try:
        rec = record()
        if _logged_pid != rec["pid"]:
            _logged_pid = rec["pid"]
            states = ", ".join(f"{k}={v['state']}" for k, v in rec["patches"].items())
            log.get().info("process pid=%s role=%s instance=%s patched by omni-patches %s: %s (state dir %s)",
                           rec["pid"], rec["role"], rec["instance"], rec["omni_patches"], states, writer_dir())
        _keep(rec)
        _update_gauge(rec["patches"])
    except Exception:
        log.once(30, ("proof", "error"), "could not record what omni-patches applied", exc_info=True)


def started():
    """Called by the engine once its gates decided (the first vLLM-family import): record this process even
    when no patch applies in it (a driver, a worker where everything is skipped), so ``status --all-processes``
    lists every process of the instance the shim runs in. Never raises."""
    from . import log

    if _written_pid == os.getpid():
        return
    try:
        _keep(record())
    except Exception:
        log.once(30, ("proof", "error"), "could not record this process", exc_info=True)


def _inactive_record():
    pid = os.getpid()
    start = start_time(pid)
    info = ray_info()
    rec = {"pid": pid, "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "start": start,
           "started": started_at(start), "updated": time.time(), "host": os.uname().nodename,
           "boot_id": boot("boot_id"), "instance": os.environ.get(INSTANCE), "omni_patches": __version__,
           "python": sys.executable, **role(info=info), "inactive": _inactive_reason, "patches": {}}
    if info is not None:
        rec["ray"] = {k: v for k, v in info.items() if k != "worker_mode"}
    return rec


def inactive_here(why_inactive):
    """vLLM's plugin entry point calls this after its activation attempt. In a process of a serving instance
    (``OMNI_PATCHES_INSTANCE`` inherited from a process where the shim ran) where the shim stays off (the
    node's own ``OMNI_PATCHES=0``, a value that is no switch), record the process as inactive, with the reason
    ``why_inactive()`` gives (None: the shim is active here after all, and started() / applied() record it): the
    instance view must show the rank that runs unpatched. Anywhere else nothing happens. Never raises."""
    global _inactive_reason
    try:
        if not (os.environ.get(INSTANCE) or "").strip() or _written_pid == os.getpid():
            return False
        why = why_inactive()
        if why is None:
            return False
        _inactive_reason = why
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

            atexit.register(remove)
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
                 "--all-processes` will not list it", writer_dir(), exc)


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
        _gauge[1].labels(patch=pid).set(1 if info["state"] == State.APPLIED else 0)


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
