"""Two Ray nodes on loopback, a real vLLM instance across them, and what omni-patches reports about it.

``python ray_cluster.py CONFIG_JSON`` (run by tests/test_ray_cluster.py inside a private network namespace,
``unshare --net``, as the leader of its own session) with CONFIG_JSON holding ``python`` (stack interpreter
with ray), ``model`` (tests/support/ray_model.py output), ``support`` (this directory), ``work`` (a short
scratch directory: Ray's unix sockets must stay under 108 characters), ``out`` (result JSON path) and
``cache`` (kept between runs: vLLM's and torch inductor's caches).

* Nodes: ``ray start --head --node-ip-address=127.0.0.1`` and ``ray start --address=127.0.0.1:<port>
  --node-ip-address=127.0.0.2``, each from an empty environment (only PATH, HOME, PYTHONPATH, VLLM_HOST_IP,
  GLOO_SOCKET_IFNAME), with its own temp dir and ports, advertising one ``NPU`` (the Ray device key of the
  test platform plugin, tests/support/ray_platform.py). In the namespace only ``lo`` exists, so nothing can
  reach any other address (Ray's gRPC servers listen on 0.0.0.0, which there means loopback only). A node
  whose ``ray start`` fails (Ray's hard-coded 30 s start-up limit, on a loaded machine) is ended and started
  once more: ``node_restarts`` in the result.
* Scenarios, each a driver (tests/support/ray_driver.py) with TP=2 over both nodes, in this order: ``on``
  (OMNI_PATCHES=1 in the driver only; V2 executor), ``legacy`` (the same, legacy executor: a second instance,
  while the first one's records are ghosts), ``off`` (unset) and ``excluded`` (OMNI_PATCHES=1, VLLM_PLUGINS
  naming only the platform plugin). Node 2's raylet has ``OMNI_PATCHES_LORA_CPU_FUSED_DELTA=0`` and the
  drivers set it to 1: switch precedence per executor. ``omni-patches status --all-processes --ray ADDRESS``
  runs while ``on`` and ``legacy`` serve and after they exit (``on`` loses its node-2 worker to SIGKILL before it
  stops: a record whose exit handlers never ran); then ``--prune``. The KV store is also read directly.
* Clean-up: every process of this session (Ray's daemons and workers, drivers) is ended by pid, and the new
  /dev/shm files those processes mapped (sampled every half second while they run), that vLLM's CPU
  communicator named after this run's TCPStore port, or that name one of this session's pids
  (``sem.hdr<pid>-…``) are removed. Nothing else is touched.
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

HEAD_IP, NODE_IP = "127.0.0.1", "127.0.0.2"
NODE_LOCAL = ("OMNI_PATCHES_LORA_CPU_FUSED_DELTA", "0")  # in node 2's raylet environment; drivers set it to 1
PLATFORM_PLUGIN = "omni_test_ray_cpu"


def loopback_up():
    """Bring ``lo`` up in this (fresh) network namespace."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = struct.pack("16sH14s", b"lo", 0, b"")
            flags = struct.unpack("16sH14s", fcntl.ioctl(s, siocgifflags, req))[1]
            fcntl.ioctl(s, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b""))
            return
        except OSError:
            pass
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def interfaces():
    """Addresses of this namespace (proof that only loopback exists)."""
    import socket

    return sorted(name for _, name in socket.if_nameindex())


def free_port(ip):
    import socket

    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def plugin_dir(work, support):
    """A directory holding the test platform plugin as an installed distribution (entry point + module)."""
    path = os.path.join(work, "plugin")
    dist = os.path.join(path, f"{PLATFORM_PLUGIN}-0.0.0.dist-info")
    os.makedirs(dist, exist_ok=True)
    shutil.copy(os.path.join(support, "ray_platform.py"), os.path.join(path, f"{PLATFORM_PLUGIN}.py"))
    with open(os.path.join(dist, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: {PLATFORM_PLUGIN}\nVersion: 0.0.0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as fh:
        fh.write(f"[vllm.platform_plugins]\n{PLATFORM_PLUGIN} = {PLATFORM_PLUGIN}:register\n")
    return path


class Cluster:
    def __init__(self, cfg):
        self.python = cfg["python"]
        self.bin = os.path.dirname(self.python)
        self.work = cfg["work"]
        self.support = cfg["support"]
        self.model = cfg["model"]
        self.home = os.path.join(self.work, "home")  # vLLM's config root (ray_non_carry_over_env_vars.json) too
        os.makedirs(self.home, exist_ok=True)
        # Caches kept between runs, under the test cache root: vLLM's model-info cache (else a subprocess imports
        # vLLM to inspect the model class, ~12 CPU-s) and torch inductor's (the CPU ISA probes it compiles).
        self.caches = {"VLLM_CACHE_ROOT": os.path.join(cfg["cache"], "vllm"),
                       "TORCHINDUCTOR_CACHE_DIR": os.path.join(cfg["cache"], "inductor")}
        self.state = os.path.join(self.work, "state")
        self.pythonpath = os.pathsep.join([plugin_dir(self.work, self.support), self.support])
        self.gcs_port = free_port(HEAD_IP)
        self.address = f"{HEAD_IP}:{self.gcs_port}"
        self.log = open(os.path.join(self.work, "cluster.log"), "a")
        # vLLM's CPU communicator names its /dev/shm files after the TCPStore port, which the V2 executor takes
        # from VLLM_DP_MASTER_PORT + 100 (0 + 100 unset): a port of this run's own makes the names unique.
        self.next_dp_port = random.randrange(20000, 40000, 1000)
        self.shm_prefixes = []
        self.temps = []  # the nodes' temp dirs, removed at the end
        self.restarts = []  # nodes whose first `ray start` failed and that were started once more (start_node)

    def base_env(self, ip, **extra):
        """An empty environment plus what a node or driver needs (``env -i`` semantics)."""
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": self.home, "LANG": "C.UTF-8",
               "PYTHONPATH": self.pythonpath, "VLLM_HOST_IP": ip, "GLOO_SOCKET_IFNAME": "lo",
               "RAY_USAGE_STATS_ENABLED": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "TMPDIR": self.work,  # vLLM's IPC sockets and other temporary files: removed with the run's directory
               **self.caches}
        env.update({k: str(v) for k, v in extra.items() if v is not None})
        return env

    def start_node(self, ip, head, **env):
        """``ray start`` for one node, on its own temp dir and free ports. A try that fails without ``omni_patches``
        in its output is ended (every process of this session run from its temp dir) and started once more on a
        fresh temp dir and fresh ports (a head on a fresh GCS port), kept in ``self.restarts``: Ray gives a
        starting node 30 s (hard-coded) to show up in the GCS, which a loaded 2-core machine can exceed (CI,
        2026-12-07: node 2's first RPC to the GCS took 31 s). A second failure raises."""
        for attempt in (1, 2):
            temp = os.path.join(self.work, ("h" if head else "n") + ("" if attempt == 1 else str(attempt)))
            self.temps.append(temp)
            os.makedirs(temp, exist_ok=True)
            cmd = [os.path.join(self.bin, "ray"), "start", f"--node-ip-address={ip}", f"--temp-dir={temp}",
                   "--num-cpus=1", '--resources={"NPU": 1}', "--object-store-memory=100000000",
                   "--disable-usage-stats",
                   f"--dashboard-agent-listen-port={free_port(ip)}", f"--dashboard-agent-grpc-port={free_port(ip)}",
                   f"--metrics-export-port={free_port(ip)}", f"--runtime-env-agent-port={free_port(ip)}",
                   f"--node-manager-port={free_port(ip)}", f"--object-manager-port={free_port(ip)}"]
            if head:
                cmd += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false",
                        f"--dashboard-port={free_port(ip)}", f"--ray-client-server-port={free_port(ip)}"]
            else:
                cmd += [f"--address={self.address}"]
            self.log.write(f"\n$ {' '.join(cmd)}\n")
            self.log.flush()
            begin = self.log.tell()
            try:
                subprocess.run(cmd, env=self.base_env(ip, **env), stdout=self.log, stderr=subprocess.STDOUT,
                               check=True, timeout=180)
                return
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                with open(self.log.name, errors="replace") as fh:
                    fh.seek(begin)
                    output = fh.read()
                if attempt == 2 or "omni_patches" in output:
                    raise
                lines = [line.strip() for line in output.splitlines() if line.strip()]
                cause = next((line for line in reversed(lines) if re.match(r"(\w+\.)*\w*(Error|Exception)\b", line)),
                             f"{type(exc).__name__}: {exc}")
                self.restarts.append({"ip": ip, "head": head, "cause": cause, "ended": end_processes_under(temp)})
                self.log.write(f"\n# node {ip} failed to start ({cause}); its processes ended, started once more\n")
                if head:
                    self.gcs_port = free_port(HEAD_IP)
                    self.address = f"{HEAD_IP}:{self.gcs_port}"

    def nodes(self):
        code = ("import json, ray; ray.init(address=%r, logging_level='ERROR');"
                "print(json.dumps([{'ip': n['NodeManagerAddress'], 'alive': n['Alive'],"
                " 'npu': n['Resources'].get('NPU')} for n in ray.nodes()]))" % self.address)
        return self._last_json(code, "listing nodes")

    def _last_json(self, code, what):
        """The JSON on the last line ``code`` prints, run by the stack's interpreter on the head node's env."""
        out = subprocess.run([self.python, "-c", code], env=self.base_env(HEAD_IP), capture_output=True, text=True,
                             timeout=120)
        if out.returncode:
            raise RuntimeError(f"{what} failed: {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def driver(self, name, **env):
        """Start a driver; returns (process, result path, stop file)."""
        out = os.path.join(self.work, f"{name}.json")
        stop = os.path.join(self.work, f"{name}.stop")
        log = open(os.path.join(self.work, f"{name}.log"), "w")
        dp_port, self.next_dp_port = self.next_dp_port, self.next_dp_port + 1000
        self.shm_prefixes.append(f"{dp_port + 100}-")
        env = self.base_env(HEAD_IP, OMNI_PATCHES_STATE_DIR=self.state, RAY_ADDRESS=self.address,
                            VLLM_DP_MASTER_PORT=dp_port,
                            VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                            VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONUNBUFFERED="1", **env)
        proc = subprocess.Popen([self.python, os.path.join(self.support, "ray_driver.py"), self.model, out, stop],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        return proc, out, stop

    def wait_result(self, proc, out, name, timeout=600):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(out):
                with open(out) as fh:
                    return json.load(fh)
            if proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"driver {name} gave no result (exit {proc.poll()}):\n{tail(self.work, name + '.log')}")

    def kv_keys(self):
        """The keys of omni-patches' namespace in the cluster's KV store, read with Ray's GCS client directly."""
        code = ("import json; from ray._raylet import GcsClient; from omni_patches.proof import KV_NAMESPACE;"
                "g = GcsClient(address=%r);"
                "keys = g.internal_kv_keys(b'', namespace=KV_NAMESPACE.encode(), timeout=30);"
                "print(json.dumps(sorted(k.decode() for k in keys)))" % self.address)
        return self._last_json(code, "listing the KV store")

    def status(self, *args):
        cmd = [self.python, "-m", "omni_patches", "status", "--all-processes", "--ray", self.address, "--json", *args]
        started = time.monotonic()
        out = subprocess.run(cmd, env=self.base_env(HEAD_IP, OMNI_PATCHES_STATE_DIR=self.state), capture_output=True,
                             text=True, timeout=120)
        try:
            data = json.loads(out.stdout)
        except ValueError:
            data = None
        return {"rc": out.returncode, "json": data, "stderr": out.stderr[-3000:],
                "seconds": round(time.monotonic() - started, 2)}

    def status_text(self, *args):
        cmd = [self.python, "-m", "omni_patches", "status", "--all-processes", "--ray", self.address, *args]
        out = subprocess.run(cmd, env=self.base_env(HEAD_IP, OMNI_PATCHES_STATE_DIR=self.state), capture_output=True,
                             text=True, timeout=120)
        return {"rc": out.returncode, "text": out.stdout, "stderr": out.stderr[-3000:]}


def tail(work, name, n=80):
    try:
        with open(os.path.join(work, name), errors="replace") as fh:
            return "".join(fh.readlines()[-n:])
    except OSError:
        return "<no log>"


def run_scenario(cluster, name, *, while_serving=None, before_stop=None, **env):
    proc, out, stop = cluster.driver(name, **env)
    procs = []
    try:
        result = cluster.wait_result(proc, out, name)
        # The workers as they are now, serving (the driver waits for the stop file): their identities, not pids.
        procs = [i for i in (identity(w["pid"]) for w in result.get("workers", [])) if i is not None]
        if while_serving is not None:
            result["while_serving"] = while_serving()
        if before_stop is not None:
            before_stop(result)
    finally:
        open(stop, "w").close()
        try:
            result_rc = proc.wait(180)
        except subprocess.TimeoutExpired:
            proc.kill()
            result_rc = proc.wait(30)
    result["driver_exit"] = result_rc
    # Ray ends the job's workers after the driver: wait until they are gone, so that what is read next is final.
    result["workers_ended"] = bool(wait_until(lambda: not any(pid_running(i) for i in procs), 60))
    # vLLM's warning when it replaces a variable a worker already had (Ray forwards worker logs to the driver).
    with open(os.path.join(cluster.work, f"{name}.log"), errors="replace") as fh:
        result["overwrites"] = sorted({line.split("Overwriting environment variable ", 1)[1].strip()
                                       for line in fh if "Overwriting environment variable OMNI_PATCHES" in line})
    return result


def kill_worker(result, ip):
    """SIGKILL the instance's worker on ``ip`` (what the OOM killer does): no exit handler of it runs."""
    pid = next(w["pid"] for w in result["workers"] if w["node_ip"] == ip)
    proc = identity(pid)
    os.kill(pid, signal.SIGKILL)
    result["killed"] = {"pid": pid, "ended": bool(wait_until(lambda: not pid_running(proc), 30, 0.2))}


def wait_until(pred, timeout, step=1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


# -- clean-up: this session's processes and the shared memory they mapped ---------------------------------
def session_pids(sid):
    """The pids of session ``sid`` but this process's."""
    pids = (int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid())
    return [pid for pid in pids if (proc_stat(pid) or (None, None))[1] == sid]


def mapped_shm(pids):
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
                    if path.startswith("/dev/shm/"):
                        found.add(path.replace(" (deleted)", ""))
        except OSError:
            continue
    return found


class Reaper:
    """Ends every process of this session and removes the shared-memory files they created."""

    def __init__(self):
        import threading

        self.sid = os.getsid(0)
        self.shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        self.shm_seen = set()
        self.pids_seen = set()
        self.prefixes = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.5):
            self.look()

    def look(self):
        pids = session_pids(self.sid)
        self.pids_seen.update(pids)
        self.shm_seen |= mapped_shm(pids)

    def reap(self):
        self._stop.set()
        self._thread.join(5)
        self.look()
        killed = set()  # identities: a pid that ended may be another session's process by the end of the loop
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10), (signal.SIGKILL, 5)):
            # listed again each round: a dying parent may have spawned
            procs = [i for i in map(identity, session_pids(self.sid)) if i is not None and pid_running(i)]
            killed.update(procs)
            for proc in procs:
                signal_if_same(proc, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(pid_running(i) for i in procs):
                time.sleep(0.2)
        pids = sorted({pid for pid, _ in killed})
        self.pids_seen.update(pids)
        named = {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if _ours_by_name(n, self)}
        ours = sorted(p for p in self.shm_seen | named if os.path.basename(p) not in self.shm_before)
        removed = []
        for path in ours:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:  # its owner cleaned up after itself
                pass
        return {"killed": len(pids), "left": sorted(i[0] for i in killed if pid_running(i)), "shm_of_run": ours,
                "shm_removed": removed, "shm_left": [p for p in ours if os.path.exists(p)]}


def _ours_by_name(name, reaper):
    """Files named after something of this run: vLLM's CPU communicator (``<TCPStore port>-…-cpushm_<rank>``)
    and the named semaphore pairs a library in the workers creates as ``sem.hdr<pid>-…``/``sem.obj<pid>-…``
    (never mapped long enough to be sampled; the creator's pid is in the name)."""
    if "-cpushm_" in name and name.startswith(tuple(reaper.prefixes or ("\0",))):
        return True
    m = re.match(r"sem\.(?:hdr|obj)(\d+)-", name)
    return bool(m) and int(m.group(1)) in reaper.pids_seen


def end_processes_under(temp):
    """SIGTERM (then SIGKILL) every process of this session whose command line names ``temp`` or a path in it: a
    node's raylet, GCS, agents and workers (a raylet that did register unregisters on SIGTERM). Their pids."""
    def names_temp(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().decode(errors="replace").split("\0")
        except OSError:
            return False
        return any(a == temp or a.endswith("=" + temp) or temp + os.sep in a for a in args)

    procs = [i for i in map(identity, session_pids(os.getsid(0))) if i is not None and names_temp(i[0])]
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        for proc in procs:
            signal_if_same(proc, sig)
        if wait_until(lambda: not any(pid_running(i) for i in procs), wait, 0.2):
            break
    return sorted(pid for pid, _ in procs)


def proc_stat(pid):
    """``(state, session id, start time in clock ticks)`` of ``pid`` from /proc, or None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()  # from field 3 (state) on: session is 6, start time 22
    except OSError:
        return None
    return fields[0], int(fields[3]), int(fields[19])


def identity(pid):
    """``(pid, start time)``: one process, which a pid alone is not once time passes (pid_max is 32,768 on the test
    machines, and the suite's processes wrap it within minutes: a pid killed a few seconds ago may be another
    test's process now, CI 2026-12-07). None where ``pid`` is gone."""
    found = proc_stat(pid)
    return None if found is None else (pid, found[2])


def pid_running(proc):
    """Whether ``proc`` -- a pid, or an :func:`identity` to be sure it is the same process -- is alive (a zombie
    is not: it has ended and awaits its reaper)."""
    pid, started = proc if isinstance(proc, tuple) else (proc, None)
    found = proc_stat(pid)
    return found is not None and found[0] != "Z" and started in (None, found[2])


def signal_if_same(proc, sig):
    """Send ``sig`` to the :func:`identity` ``proc`` only while its pid is still that process."""
    if pid_running(proc):
        try:
            os.kill(proc[0], sig)
        except ProcessLookupError:
            pass


def main(cfg_path):
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    reaper = Reaper()
    result = {"timings": {}}
    t0 = time.monotonic()
    cluster = None
    try:
        loopback_up()
        result["interfaces"] = interfaces()
        cluster = Cluster(cfg)
        reaper.prefixes = cluster.shm_prefixes
        result["node_restarts"] = cluster.restarts
        cluster.start_node(HEAD_IP, head=True)
        result["address"] = cluster.address
        # A node-local switch (set where the raylet starts): the V2 executor keeps it, the legacy one overwrites
        # it with the driver's value.
        cluster.start_node(NODE_IP, head=False, **{NODE_LOCAL[0]: NODE_LOCAL[1]})
        result["nodes"] = wait_until(lambda: (lambda n: n if len([x for x in n if x["alive"]]) == 2 else None)(
            cluster.nodes()), 60) or cluster.nodes()
        result["timings"]["cluster"] = round(time.monotonic() - t0, 1)
        on = {"OMNI_PATCHES": "1", NODE_LOCAL[0]: "1"}

        def serving_view():
            return {"status": cluster.status(), "all": cluster.status("--all"), "text": cluster.status_text()}

        t = time.monotonic()
        # Node 2's worker is SIGKILLed while serving: its record stays behind. Ray ends the other one when the
        # driver exits, with or without its exit handlers (it varies): its record may stay or be gone.
        result["on"] = run_scenario(cluster, "on", while_serving=serving_view,
                                    before_stop=lambda r: kill_worker(r, NODE_IP), **on)
        result["timings"]["on"] = round(time.monotonic() - t, 1)
        result["after_on"] = {"default": wait_until(lambda: _all_gone(cluster.status()), 60) or cluster.status(),
                              "text": cluster.status_text(), "kv": cluster.kv_keys()}
        t = time.monotonic()
        # The legacy executor, a new instance: while it serves, the first instance's records are ghosts.
        result["legacy"] = run_scenario(cluster, "legacy", while_serving=serving_view,
                                        VLLM_USE_RAY_V2_EXECUTOR_BACKEND="0", **on)
        result["timings"]["legacy"] = round(time.monotonic() - t, 1)
        result["after_legacy"] = wait_until(lambda: _all_gone(cluster.status("--all")), 60) or cluster.status("--all")
        result["kv_after_legacy"] = cluster.kv_keys()
        result["prune"] = cluster.status("--prune")
        result["after_prune"] = cluster.status("--all")

        t = time.monotonic()
        result["off"] = run_scenario(cluster, "off", while_serving=lambda: cluster.status("--all"))
        result["timings"]["off"] = round(time.monotonic() - t, 1)
        t = time.monotonic()
        result["excluded"] = run_scenario(cluster, "excluded", while_serving=lambda: cluster.status("--all"),
                                          OMNI_PATCHES="1", VLLM_PLUGINS=PLATFORM_PLUGIN)
        result["timings"]["excluded"] = round(time.monotonic() - t, 1)
    except Exception as exc:  # reported to the test with the logs it needs
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["logs"] = {name: tail(cfg["work"], name) for name in
                          ("cluster.log", "on.log", "legacy.log", "off.log", "excluded.log")}
    finally:
        result["cleanup"] = reaper.reap()
        for temp in cluster.temps if cluster else ():
            shutil.rmtree(temp, ignore_errors=True)
        result["timings"]["total"] = round(time.monotonic() - t0, 1)
        with open(cfg["out"], "w") as fh:
            json.dump(result, fh, indent=1)


def _all_gone(status):
    """The default view once every record of the finished instance is gone (hidden or shown as gone)."""
    procs = (status.get("json") or {}).get("processes")
    if procs is None:
        return None
    return status if all(p.get("status") == "gone" for p in procs) else None


if __name__ == "__main__":
    main(sys.argv[1])
