"""Proof in production: what each process of a serving instance actually patched.

Nothing here runs at interpreter start-up. At the first vLLM-family import the engine calls
:func:`ensure_instance` (the serving-instance id, see below); after every successful application it calls
:func:`applied`. The first application in a process logs one INFO line (pid, role, patch states), and every
application

* rewrites ``<state dir>/<pid>.json`` atomically (temp file + ``os.replace``: a reader never sees half a
  file, concurrent writers never share a file), removed again at interpreter exit (``atexit``);
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

State directory: ``$OMNI_PATCHES_STATE_DIR`` if set (give each serving instance its own), else
``$XDG_RUNTIME_DIR/omni-patches``, else ``<tempdir>/omni-patches-<uid>`` (mode 0700; a directory owned by
someone else is not written to).

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


def state_dir(environ=os.environ):
    explicit = environ.get("OMNI_PATCHES_STATE_DIR", "").strip()
    if explicit:
        return explicit
    runtime = environ.get("XDG_RUNTIME_DIR", "").strip()
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "omni-patches")
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"omni-patches-{os.getuid()}")


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


def _start_time(pid):
    """Kernel start time of ``pid`` in clock ticks after boot (Linux), so a reused pid is not taken for the
    recorded process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


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
    import json
    import tempfile

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


def refresh():
    """Record this process again (e.g. once vLLM's rank is known). Cheap when nothing applied; never raises."""
    state = _current_state()
    if state is None or _written_pid != os.getpid():
        return False
    try:
        rec = record(state)
        write(rec)
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
    global _written_pid, _logged_pid, _at_fork_registered, _atexit_registered
    from . import log

    try:
        rec = record(state)
        if _logged_pid != rec["pid"]:
            _logged_pid = rec["pid"]
            states = ", ".join(f"{k}={v['state']}" for k, v in rec["patches"].items())
            log.get().info("process pid=%s role=%s instance=%s patched by omni-patches %s: %s (state dir %s)",
                           rec["pid"], rec["role"], rec["instance"], rec["omni_patches"], states, state_dir())
        _publish_quietly(rec)
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


def _local_alive(rec):
    """Whether the recorded process still runs, judged on this machine (only valid on the same boot)."""
    pid = rec.get("pid")
    if not (isinstance(pid, int) and alive(pid)):
        return False
    if rec.get("start") is not None and _start_time(pid) not in (None, rec["start"]):
        return False  # the pid was reused by another process
    return True


def _status(is_alive):
    return {True: "running", False: "gone", None: "unknown"}[is_alive]


def collect(directory=None):
    """Every record in the state directory, each with ``alive`` set; unreadable files are reported, not fatal."""
    import json

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
        rec["source"] = "local"
        rec["alive"] = _local_alive(rec)
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


def prune(directory=None):
    """Remove the records of dead processes from the state directory. Returns the files removed."""
    removed = []
    for rec in collect(directory):
        if rec.get("status") != "gone":
            continue
        try:
            os.unlink(rec["file"])
            removed.append(rec["file"])
        except FileNotFoundError:
            pass
    return removed


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
        except ValueError as exc:
            out.append({"key": skey, "error": str(exc), "alive": False, "status": "unreadable", "source": "ray"})
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
    """The cluster's records plus this host's local ones of the same instances that Ray does not hold (the
    driver / engine core usually applies its patches before it connects to Ray)."""
    instances = {r.get("instance") for r in ray_records if r.get("instance")}
    seen = {(r.get("boot_id"), r.get("pid")) for r in ray_records}
    extra = [r for r in local_records if r.get("instance") in instances
             and (r.get("boot_id"), r.get("pid")) not in seen]
    return ray_records + extra
