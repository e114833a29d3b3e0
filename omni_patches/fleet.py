"""The fleet view: reads the process records :mod:`omni_patches.proof` writes, for ``omni-patches status
--all-processes`` (only the CLI imports this; serving processes never do).

:func:`collect` (state directory) and :func:`collect_ray` (the Ray cluster's KV store; imports ray),
:func:`visible` (hides ghosts), :func:`instances` (ranks per serving instance), :func:`prune` /
:func:`prune_ray` (remove the records of dead processes), :func:`merge_local`.
"""
import os
import time

from . import proof


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
    state, start = proof.proc_stat(pid)
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

    directory = directory or proof.state_dir()
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
        if rec.get("boot_id") and proof.boot("boot_id") and rec["boot_id"] != proof.boot("boot_id"):
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
    directory = directory or proof.state_dir()
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
        started = proof.started_at(proof.proc_stat(int(pid))[1])
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

    directory = directory or proof.state_dir()
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
        with open(os.path.join(directory or proof.state_dir(), PRUNED)) as fh:
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


class Cluster:
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
        return self.gcs.internal_kv_keys(b"", namespace=proof.KV_NAMESPACE.encode(), timeout=30)

    def get(self, keys):
        if not keys:
            return {}
        return self.gcs.internal_kv_multi_get(list(keys), namespace=proof.KV_NAMESPACE.encode(), timeout=30)

    def delete(self, key):
        return self.gcs.internal_kv_del(key, False, namespace=proof.KV_NAMESPACE.encode(), timeout=30)

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
    if rec.get("boot_id") and rec.get("boot_id") == proof.boot("boot_id"):
        return _local_alive(rec)  # same machine: the kernel knows
    if actor is not None:
        return True
    return None


def collect_ray(address=None, cluster=None):
    """Every record in the cluster's KV store, each with ``status`` running / gone / unknown and its node."""
    import json

    cluster = cluster or Cluster(ray_address(address))
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
    cluster = cluster or Cluster(ray_address(address))
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
