"""A real ``vllm serve <tiny model> --omni`` on 127.0.0.1, with and without the shim (serving tier, demo).

Pieces, all cached under the test cache root (``support.wheels.CACHE``):

* ``serving_python(omni)`` -- the stack venv of ``support.stacks`` with this checkout installed non-editably (its
  ``.pth`` is what activates the shim in every process the server starts);
* ``server_path(omni)`` -- the server's ``PYTHONPATH`` (the stack venvs themselves are not changed):
  ``extras_dir(omni)``, what the stack lacks to *serve* (``SERVING_EXTRAS``: janus, msgpack, soundfile, av for
  0.30.0 and 0.32.0rc1) installed ``--target`` with the stack's own pip, and ``plugin_dir()``, the test-support CPU platform
  (``support/serving_cpu_platform.py``) with the dist-info registering it under ``vllm_omni.platform_plugins`` and
  a torchaudio stand-in (the stacks remove the CUDA torchaudio; vllm-omni's OpenAI server imports it at start-up);
* ``tiny_model(omni)`` -- ``support/serving_model.py`` run once per stack: the model directory and LoRA files;
* ``Server`` -- one server process group: started with a free port, waited on ``/health``, asked for PNGs, its
  processes listed from ``/proc``, stopped by PID (SIGTERM to its process group, SIGKILL after a grace period,
  then every process of its session and the shared-memory files its processes held).
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

from .stacks import install_project, stack_python
from .wheels import CACHE, keep_bytecode, locked, sandbox

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
SERVING = CACHE / "serving"

_COMMON_EXTRAS = ["janus==2.0.0", "msgpack==1.2.4", "soundfile==0.14.0"]
_AV = "av==18.0.0"  # vllm-omni 0.32.0rc1's own dev pin; 0.30.0's API server imports it too
#: omni version -> what serving needs beyond the stack (``--no-deps``: cffi/pycparser are soundfile's).
SERVING_EXTRAS: dict[str, list[str]] = {
    "0.28.0": _COMMON_EXTRAS,
    "0.30.0": _COMMON_EXTRAS + [_AV],
    "0.32.0rc1": _COMMON_EXTRAS + [_AV],
    # HunyuanImage3's DiT-only pipeline on 0.22.0: its API server imports pydub, the model x-transformers (einx,
    # frozendict are that one's imports).
    "0.22.0": _COMMON_EXTRAS + [_AV, "pydub==0.25.1", "x-transformers==2.12.2", "einx==0.4.3", "frozendict==2.5.1"],
}
#: The stacks the Wan serving tier (tests/test_serving.py) runs on; 0.22.0 serves the MoE tier's tiny
#: HunyuanImage3 (tests/test_serving_moe.py), where the EP patch is in range.
WAN_STACKS = ("0.28.0", "0.30.0", "0.32.0rc1")

PLATFORM_PACKAGE = "omni_patches_test_cpu_platform"
#: TEST SUPPORT env switch read by serving_cpu_platform.py: "1" makes a diffusion stage process hang in its start-up.
STAGE_INIT_HANG = "OMNI_SERVING_TEST_STAGE_INIT_HANG"
# The entry point's module must not import vllm_omni: vllm-omni loads it while resolving its own platform.
_PLATFORM_INIT = f'''"""TEST SUPPORT: registers the CPU platform of omni-patches' serving tier (see .platform)."""


def plugin():
    return "{PLATFORM_PACKAGE}.platform.CpuOmniPlatform"
'''
_TORCHAUDIO_STANDIN = '''"""TEST SUPPORT stand-in for torchaudio (the stack removes PyPI's CUDA build, which cannot load on CPU torch).

vllm-omni's OpenAI server imports it at start-up; the image path never calls it. Any use raises."""
__version__ = "0.0.0+omni-patches-test-standin"


def __getattr__(name):
    raise AttributeError(f"torchaudio.{name}: torchaudio is a stand-in in this test stack")
'''
_TORCHAUDIO_FUNCTIONAL = '''"""TEST SUPPORT stand-in: the names vllm-omni imports from torchaudio.functional at start-up."""


def melscale_fbanks(*args, **kwargs):
    raise NotImplementedError("torchaudio is a stand-in in this test stack")
'''

_installed: dict[str, Path] = {}


def _installed_is_current(python: Path) -> bool:
    """Whether the omni-patches installed in ``python``'s venv is this checkout, file for file (so a warm run
    skips the ~30 s reinstall): every module, the registry and the start-up files."""
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    src, dst = ROOT / "omni_patches", site / "omni_patches"
    mine = sorted(p.relative_to(src) for p in src.rglob("*.py"))
    theirs = sorted(p.relative_to(dst) for p in dst.rglob("*.py"))
    pairs = [(src / r, dst / r) for r in mine] + [(ROOT / "patches.toml", dst / "patches.toml")]
    pairs += [(src / name, site / name) for name in ("omni_patches.pth", "omni_patches.start")]
    try:
        return mine == theirs and all(a.read_bytes() == b.read_bytes() for a, b in pairs)
    except OSError:
        return False


def serving_python(omni: str) -> Path:
    """The stack's interpreter with this checkout installed (non-editably: the stack runs the code under test)."""
    if omni not in _installed:
        python = stack_python(omni)
        with locked(f"serving-install-{omni}"):
            if not _installed_is_current(python):
                install_project(python, ROOT)
        _installed[omni] = python
    return _installed[omni]


def clean_child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OMNI_PATCHES") and k not in ("PYTHONPATH", "VIRTUAL_ENV",
                                                              "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY")}
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    # Bytecode as the test suite keeps it; the demo and bench/serving_moe.py start their servers through here too.
    return keep_bytecode(env)


def _plugin_files(target: Path) -> None:
    """The CPU platform module and the dist-info that registers it (``vllm_omni.platform_plugins``)."""
    pkg = target / PLATFORM_PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text(_PLATFORM_INIT)
    shutil.copyfile(SUPPORT / "serving_cpu_platform.py", pkg / "platform.py")
    shutil.copyfile(SUPPORT / "serving_cpu_attention.py", pkg / "attention.py")
    # The CPU MoE stand-ins, installed by the platform only under OMNI_SERVING_TEST_MOE_STANDINS=1 (MoE tier).
    shutil.copyfile(SUPPORT / "cpu_moe_standins.py", pkg / "moe_standins.py")
    info = target / f"{PLATFORM_PACKAGE}-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLATFORM_PACKAGE}\nVersion: 0.0.0\n"
                                   "Summary: omni-patches TEST SUPPORT: a CPU platform for vllm-omni\n")
    (info / "entry_points.txt").write_text(f"[vllm_omni.platform_plugins]\ncpu_test = {PLATFORM_PACKAGE}:plugin\n")
    (info / "top_level.txt").write_text(PLATFORM_PACKAGE + "\n")
    ta = target / "torchaudio"
    ta.mkdir()
    (ta / "__init__.py").write_text(_TORCHAUDIO_STANDIN)
    (ta / "functional.py").write_text(_TORCHAUDIO_FUNCTIONAL)


def _cached_dir(name: str, recipe: str, fill) -> Path:
    """``SERVING/<name>-<sha256(recipe)[:12]>``, filled once by ``fill(tmp)`` and renamed into place."""
    return sandbox(name, recipe, fill, root=SERVING)


def extras_dir(omni: str) -> Path:
    """``--target`` directory of what the stack lacks to serve (``SERVING_EXTRAS``), installed with its own pip."""
    python = stack_python(omni)

    def fill(tmp):
        need = list(SERVING_EXTRAS[omni])
        if subprocess.run([str(python), "-c", "import cffi, pycparser"], capture_output=True).returncode:
            need += ["cffi==2.1.1", "pycparser==3.12"]
        proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), *need],
                              capture_output=True, text=True, env=clean_child_env())
        if proc.returncode:
            raise RuntimeError(f"installing the serving extras {need} failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")

    return _cached_dir(f"extras-{omni}", json.dumps([omni, SERVING_EXTRAS[omni], str(python)]), fill)


def plugin_dir() -> Path:
    """The CPU platform package + its dist-info (``vllm_omni.platform_plugins``) and the torchaudio stand-in."""
    recipe = json.dumps([(SUPPORT / "serving_cpu_platform.py").read_text(),
                         (SUPPORT / "serving_cpu_attention.py").read_text(),
                         (SUPPORT / "cpu_moe_standins.py").read_text(), _PLATFORM_INIT, _TORCHAUDIO_STANDIN,
                         _TORCHAUDIO_FUNCTIONAL])
    return _cached_dir("plugin", recipe, _plugin_files)


def server_path(omni: str) -> str:
    """The ``PYTHONPATH`` of a test server: the CPU platform plugin, then the serving extras."""
    return os.pathsep.join([str(plugin_dir()), str(extras_dir(omni))])


def tiny_model(omni: str) -> dict:
    """The tiny Wan model and its LoRA files, written once per stack (``support/serving_model.py``)."""
    return _written_model(omni, "serving_model.py", "model", "SERVING_MODEL")


def tiny_hy3_model(omni: str) -> dict:
    """The tiny HunyuanImage3 (DiT-only serving; ``support/serving_model_hy3.py``), written once per stack. The
    writer imports vllm-omni's HunyuanImage3 modules, which need a resolved platform: it runs with the test
    server's ``PYTHONPATH`` (the CPU platform plugin)."""
    return _written_model(omni, "serving_model_hy3.py", "model-hy3", "SERVING_MODEL_HY3",
                          env={"PYTHONPATH": server_path(omni)})


def hy3_deploy_yaml(path, **parallel) -> Path:
    """A DiT-only deploy YAML for the tiny HunyuanImage3 (``serving_model_hy3.deploy_yaml``: ``tp``, ``cfg``,
    ``ulysses``, ``ring``, ``ep``, ``seed``), for ``--deploy-config``. Plain text: written by this interpreter."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("omni_serving_model_hy3", SUPPORT / "serving_model_hy3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.deploy_yaml(path, **parallel)


class Steps:
    """Named steps of a serving run (a phase, a case), each run once: its result, or the exception it raised, is
    kept for every test that asks (``results`` / ``errors``), with its seconds (``timings``); ``_dump(name)`` is
    called after each step that succeeded."""

    def __init__(self):
        self.results, self.errors, self.timings = {}, {}, {}

    def step(self, name: str, run):
        if name not in self.results and name not in self.errors:
            t0 = time.monotonic()
            try:
                self.results[name] = run()
            except Exception as exc:  # reported by every test of the step
                self.errors[name] = exc
            else:
                self._dump(name)
            self.timings[name] = round(time.monotonic() - t0, 1)
        if name in self.errors:
            raise self.errors[name]
        return self.results[name]

    def _dump(self, name: str) -> None:
        pass


def session_workdir(name: str) -> Path:
    """``SERVING/runs/<name>-<pid>``, made empty: logs and state of this session's last run, kept for inspection
    under the cache root. Other sessions' directories of ``name`` are removed once their process is gone (two
    checkouts may serve at once)."""
    from omni_patches import fleet

    workdir = SERVING / "runs" / f"{name}-{os.getpid()}"
    for old in (SERVING / "runs").glob(f"{name}-*"):
        pid = old.name.rpartition("-")[2]
        if old == workdir or not pid.isdigit() or not fleet.alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


#: The stack the tiny HunyuanImage3 is served on (its MoE on vLLM's FusedMoE; ``moe-ep-parallel-mapping``'s range).
HY3_STACK = "0.22.0"


def hy3_server(omni: str, model: str, *, shim: bool, name: str, workdir, tp: int = 1, cfg: int = 1,
               ulysses: int = 1, ring: int = 1, ep: bool = False, args: tuple = ()) -> "Server":
    """A server (not started) of the tiny HunyuanImage3 (``tiny_hy3_model(omni)["model"]``) with its deploy YAML
    under ``workdir``; for several ranks the CPU platform answers that many "devices", and with EP the CPU MoE
    stand-ins are installed in every process (``serving_cpu_platform``'s TEST SUPPORT switches). Dynamo is off:
    its tracing of the model's small functions costs start-up time and memory on CPU and gives nothing here.
    ``args``: more ``vllm serve`` arguments (0.32.0rc1 serves it with ``--lora-backend distill``)."""
    workdir = Path(workdir)
    deploy = hy3_deploy_yaml(workdir / "deploy.yaml", tp=tp, cfg=cfg, ulysses=ulysses, ring=ring, ep=ep)
    env = {"TORCHDYNAMO_DISABLE": "1"}
    world = tp * cfg * ulysses * ring
    if world > 1:
        env["OMNI_SERVING_TEST_DEVICE_COUNT"] = str(world)
    if ep:
        env["OMNI_SERVING_TEST_MOE_STANDINS"] = "1"
    return Server(omni, model, shim=shim, name=name, args=["--deploy-config", str(deploy), *args], env=env,
                  workdir=workdir)


def _written_model(omni: str, script: str, name: str, tag: str, env: dict | None = None) -> dict:
    """What ``support/<script> OUT`` writes with the stack's interpreter, once per stack and script text, under
    ``SERVING/<name>-<omni>-<hash>``: its ``<tag> {json}`` line, paths made relative to the directory."""
    python = stack_python(omni)
    src = (SUPPORT / script).read_text()
    dst = SERVING / f"{name}-{omni}-{hashlib.sha256(src.encode()).hexdigest()[:12]}"
    info = dst / "info.json"
    with locked(f"serving-{dst.name}"):
        if not info.exists():
            tmp = dst.with_name(dst.name + ".part")
            shutil.rmtree(tmp, ignore_errors=True)
            child_env = clean_child_env()
            child_env.update(env or {})
            proc = subprocess.run([str(python), str(SUPPORT / script), str(tmp)], capture_output=True,
                                  text=True, env=child_env, timeout=600)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]
            if proc.returncode or not lines:
                raise RuntimeError(f"writing the tiny model ({script}) failed:\n{proc.stdout[-3000:]}\n"
                                   f"{proc.stderr[-5000:]}")
            written = json.loads(lines[-1].split(" ", 1)[1])
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)
            rel = {k: (str(Path(v).relative_to(tmp)) if isinstance(v, str) and v.startswith(str(tmp)) else v)
                   for k, v in written.items()}
            info.write_text(json.dumps(rel))
    rel = json.loads(info.read_text())
    return {k: (str(dst / v) if isinstance(v, str) else v) for k, v in rel.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- /proc helpers (Linux) ------------------------------------------------------------------------------------
def proc_stat(pid: int):
    """(ppid, pgid, sid, state, start time in clock ticks) of ``pid``, or None. A pid names one process only with
    its start time: pid_max is 32,768 on the test machines and the suite's processes wrap it within minutes."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0], int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _all_pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _shm_held(pid: int) -> set[str]:
    """Files under /dev/shm that ``pid`` has open or mapped."""
    held = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target.split(" (deleted)")[0])
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                held.add(parts[5].split(" (deleted)")[0])
    return held


class ServerFailed(RuntimeError):
    pass


class Server:
    """One ``vllm serve <model> --omni`` process group on 127.0.0.1 (``shim``: ``OMNI_PATCHES=1`` in its env)."""

    def __init__(self, omni: str, model: str, *, shim: bool, name: str, args=(), env=None, workdir: Path):
        self.omni, self.model, self.shim, self.name = omni, model, shim, name
        self.args, self.extra_env = list(args), dict(env or {})
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.workdir / "state"
        self.state_dir.mkdir(exist_ok=True)
        self.log_path = self.workdir / "server.log"
        # vLLM and vllm-omni put their zmq IPC sockets into the temp directory and leave them when killed: the
        # server gets its own (short: a unix socket path has 107 bytes), removed by stop().
        self.tmpdir = Path(tempfile.mkdtemp(prefix="omni-srv-"))
        self.proc = None
        self.port = None
        self.started_at = self.healthy_after = None
        self._seen: dict[int, int] = {}  # pid -> start time of every process the server had: ended ones too
        self._shm: set[str] = set()
        self.failed_starts: list[dict] = []  # start-ups that exited before healthy and were retried (wait_healthy)

    # -- environment ------------------------------------------------------------------------------------------
    def env(self) -> dict:
        python = serving_python(self.omni)
        env = clean_child_env()
        env.update({
            "PYTHONPATH": server_path(self.omni),
            "PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}",
            "VIRTUAL_ENV": str(python.parent.parent),
            "OMNI_PATCHES_STATE_DIR": str(self.state_dir),
            "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(SERVING / "hf-home"),
            "VLLM_CACHE_ROOT": str(SERVING / "vllm-cache"), "VLLM_CONFIG_ROOT": str(self.workdir / "vllm-config"),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": "INFO", "TMPDIR": str(self.tmpdir),
            # vllm-omni's file storage defaults to /tmp/storage, whatever TMPDIR says.
            "VLLM_OMNI_SERVER_STORAGE__PATH": str(self.tmpdir / "storage"),
            # Its speech serving makes ~/.cache/vllm-omni/speakers at every API server start (every release here).
            "SPEAKER_SAMPLES_DIR": str(self.tmpdir / "speakers"),
        })
        if self.shim:
            env["OMNI_PATCHES"] = "1"
        env.update({k: str(v) for k, v in self.extra_env.items()})
        return env

    def cli(self, *args: str, timeout: int = 120, shim_env: bool = True) -> subprocess.CompletedProcess:
        """``omni-patches ARGS`` in the stack, with this server's state directory."""
        env = self.env()
        if not shim_env:
            env.pop("OMNI_PATCHES", None)
        return subprocess.run([str(serving_python(self.omni)), "-m", "omni_patches", *args], capture_output=True,
                              text=True, env=env, timeout=timeout, cwd=self.workdir)

    # -- life cycle -------------------------------------------------------------------------------------------
    def start(self) -> "Server":
        python = serving_python(self.omni)
        self.port = free_port()
        cmd = [str(python.parent / "vllm"), "serve", self.model, "--omni", "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env(),
                                     cwd=self.workdir, start_new_session=True)
        return self

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now (one try)."""
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float = 600, *, restart_once: bool = True) -> float:
        """Seconds from the start until ``/health`` answers 200. A server that exits first is started again once
        (``restart_once``) where the first error in its log has no omni_patches frame -- a start-up that a loaded
        2-core machine broke, not the shim: the retry is warned about and kept in ``failed_starts`` -- and
        otherwise raises :class:`ServerFailed`, the log's first error (its root cause) at the end of the message."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.processes()  # remember every pid and shm file while they live
            if self.proc.poll() is not None:
                cause = first_error(self.log_text())
                if restart_once and not self.failed_starts and "omni_patches" not in cause:
                    self._restart(cause)
                    deadline = time.monotonic() + timeout
                    continue
                raise ServerFailed(f"server {self.name} exited with {self.proc.returncode} before it was healthy:\n"
                                   f"{self.log_tail()}\n--- the first error in {self.log_path} ---\n{cause}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as resp:
                    if resp.status == 200:
                        self.healthy_after = time.monotonic() - self.started_at
                        self.processes()
                        return self.healthy_after
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise ServerFailed(f"server {self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}\n"
                           f"--- the first error in {self.log_path} ---\n{first_error(self.log_text())}")

    def _restart(self, cause: str) -> None:
        """Start again after an exit before healthy: what is left of the first try killed, its log kept beside."""
        returncode = self.proc.returncode
        self._kill_all()
        self._log.close()
        kept = self.log_path.with_name(f"{self.log_path.stem}.failed-start-{len(self.failed_starts) + 1}.log")
        self.log_path.replace(kept)
        self.failed_starts.append({"returncode": returncode, "cause": cause, "log": str(kept)})
        warnings.warn(f"server {self.name} exited with {returncode} before it was healthy; started again once. "
                      f"The first error in its log ({kept}):\n{cause}", RuntimeWarning, stacklevel=3)
        self.start()

    def image(self, prompt: str = "a red cat sits on the mat", *, size: str = "64x64", steps: int = 2, seed: int = 0,
              lora: dict | None = None, timeout: float = 300, guidance_scale: float = 1.0) -> bytes:
        """PNG bytes of one ``/v1/images/generations`` request (``guidance_scale`` > 1: classifier-free guidance,
        what a CFG-parallel server splits)."""
        body = {"prompt": prompt, "size": size, "num_inference_steps": steps, "seed": seed, "n": 1,
                "response_format": "b64_json", "guidance_scale": guidance_scale}
        if lora is not None:
            body["lora"] = lora
        req = urllib.request.Request(self.url("/v1/images/generations"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise ServerFailed(f"{self.name}: HTTP {exc.code}: {exc.read()[:2000]!r}\n{self.log_tail()}") from exc
        self.processes()
        return base64.b64decode(doc["data"][0]["b64_json"])

    def post_json(self, path: str, body: dict, *, timeout: float = 120) -> dict:
        """``{"status": HTTP status, "body": parsed JSON (or text)}`` of one POST, error statuses included."""
        req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return {"status": status, "body": json.loads(raw)}
        except ValueError:
            return {"status": status, "body": raw.decode(errors="replace")[:2000]}

    def processes(self) -> dict[int, list[str]]:
        """Live processes of this server: its session (start_new_session) plus descendants that left it."""
        if self.proc is None:
            return {}
        root = self.proc.pid
        stats = {pid: st for pid in _all_pids() if (st := proc_stat(pid)) is not None}
        members = {pid for pid, st in stats.items() if st[2] == root and st[3] != "Z"}
        changed = True
        while changed:
            changed = False
            for pid, st in stats.items():
                if pid not in members and st[0] in members and st[3] != "Z":
                    members.add(pid)
                    changed = True
        self._seen.update((pid, stats[pid][4]) for pid in members)
        out = {}
        for pid in sorted(members):
            self._shm |= _shm_held(pid)
            out[pid] = _cmdline(pid)
        return out

    def stop(self, grace: float = 60) -> dict:
        """SIGTERM the process group, wait ``grace`` s, then SIGKILL whatever of it is left.

        Returns ``{"exited_within_grace": bool, "seconds": float, "killed": [pids], "shm_removed": [...]}``."""
        if self.proc is None:
            return {}
        if getattr(self, "stopped", None):
            return self.stopped
        self.processes()
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        exited = False
        deadline = t0 + grace
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self._live():
                exited = True
                break
            time.sleep(0.2)
        seconds = time.monotonic() - t0
        killed = self._kill_all()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        shm_removed = []
        for path in sorted(self._shm):
            if os.path.exists(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    shm_removed.append(path)
        self._log.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.stopped = {"exited_within_grace": exited, "seconds": round(seconds, 2), "killed": killed,
                        "shm_removed": shm_removed, "returncode": self.proc.returncode,
                        "remaining": self._live(), "shm_left": sorted(p for p in self._shm if os.path.exists(p))}
        return self.stopped

    def _live(self) -> list[int]:
        """The server's processes still running: each one seen, by pid *and* start time (a pid of an ended one may
        be another test's process by now, which must never be signalled or counted)."""
        self.processes()  # today's members join what was seen
        return sorted(pid for pid, started in self._seen.items()
                      if (st := proc_stat(pid)) and st[3] != "Z" and st[4] == started)

    def _kill_all(self) -> list[int]:
        killed = []
        # multiprocessing's resource tracker unlinks the semaphores (/dev/shm/sem.mp-*) its clients registered once
        # they are gone: SIGKILL everything else first and give it a few seconds to do that and exit by itself.
        trackers = {pid for pid in self._live() if any("resource_tracker" in c for c in _cmdline(pid))}
        for pid in self._live():
            if pid not in trackers:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        deadline = time.monotonic() + 10
        while trackers and time.monotonic() < deadline and any(
                (st := proc_stat(pid)) and st[3] != "Z" for pid in trackers):
            time.sleep(0.2)
        for _ in range(3):
            live = self._live()
            if not live:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in live:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.5)
        return killed

    def records(self) -> list[dict]:
        """``omni-patches status --all-processes --json`` of this server's state directory."""
        proc = self.cli("status", "--all-processes", "--json", "--state-dir", str(self.state_dir))
        try:
            return json.loads(proc.stdout)["processes"]
        except (ValueError, KeyError) as exc:
            raise AssertionError(f"status --all-processes: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}") from exc


_TRACEBACK = "Traceback (most recent call last)"
# vLLM's per-process prefix ("(APIServer pid=7) ", coloured on a terminal) before a line of a child's output.
_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)?\([\w:-]+ pid=\d+\)(\x1b\[[0-9;]*m)? ?")
_ERROR_LINE = re.compile(r"\bERROR\b|\bKilled\b|Segmentation fault|core dumped|Aborted")


def first_error(log: str, limit: int = 60) -> str:
    """The first error of a server log (the root cause a later "see root cause above" points to): its first
    traceback up to its exception line (the first line after it that is not indented once the process prefix is
    off), or else its first error-level lines; ``"<no error in the log>"``."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if _TRACEBACK in line), None)
    if start is not None:
        for end in range(start + 1, min(len(lines), start + limit)):
            body = _PREFIX.sub("", lines[end])
            if body.strip() and not body[0].isspace():
                return "\n".join(lines[start:end + 1])
        return "\n".join(lines[start:start + limit])
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return "\n".join(errors[:20]) or "<no error in the log>"


def start_all(servers, timeout: float = 600):
    """Start ``servers`` together (their imports overlap on the cores) and wait until each is healthy."""
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_healthy(timeout)
    except BaseException:
        for s in servers:
            s.stop(grace=5)
        raise
    return servers


def decode_png(omni: str, *pngs: bytes) -> list:
    """Pixel arrays (nested lists of uint8, HxWxC) of PNGs, decoded by Pillow in the stack."""
    with tempfile.TemporaryDirectory(prefix="omni-serving-png-") as tmp:
        paths = []
        for i, data in enumerate(pngs):
            p = Path(tmp) / f"{i}.png"
            p.write_bytes(data)
            paths.append(str(p))
        code = ("import json, sys, numpy as np; from PIL import Image; "
                "print(json.dumps([np.asarray(Image.open(p).convert('RGB')).tolist() for p in sys.argv[1:]]))")
        proc = subprocess.run([str(stack_python(omni)), "-c", code, *paths], capture_output=True, text=True,
                              env=clean_child_env(), timeout=120)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        return json.loads(proc.stdout)


def stage_processes(server: Server) -> list[int]:
    """Diffusion stage subprocesses (``StageDiffusionProc``) of ``server``: the children of its API server process
    other than multiprocessing's resource tracker (0.28/0.30 title them ``vLLM-Omni::DiffusionWorker``; 0.32.0rc1
    leaves the spawn command line)."""
    procs = server.processes()
    return sorted(pid for pid, cmd in procs.items()
                  if (proc_stat(pid) or (0,))[0] == server.proc.pid and not any("resource_tracker" in c for c in cmd))


def rss_bytes(pids) -> dict[int, int]:
    """``{pid: resident bytes}`` from /proc (VmRSS) of the processes still alive."""
    out = {}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[pid] = int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return out


def rss_by_process(server: "Server") -> dict[str, dict]:
    """``{pid: {"bytes": resident bytes, "cmd": its command line (120 chars)}}`` of the server's live processes: what
    the MoE tier keeps per case and ``examples/run_default.py --report`` writes."""
    procs = server.processes()
    return {str(pid): {"bytes": n, "cmd": " ".join(procs.get(pid, []))[:120]} for pid, n in rss_bytes(procs).items()}


def pixel_std(omni: str, png: bytes) -> float:
    import numpy as np

    [arr] = decode_png(omni, png)
    return float(np.asarray(arr, dtype=np.float64).std())


def image_stats(omni: str, reference: bytes, *others: bytes) -> list[dict]:
    """Per ``other``: mean and max absolute pixel difference from ``reference`` (0-255 scale) and pixel count."""
    arrays = decode_png(omni, reference, *others)
    import numpy as np

    ref = np.asarray(arrays[0], dtype=np.float64)
    out = []
    for arr in arrays[1:]:
        a = np.asarray(arr, dtype=np.float64)
        if a.shape != ref.shape:
            out.append({"shape": a.shape, "reference_shape": ref.shape})
            continue
        d = np.abs(a - ref)
        out.append({"mean": float(d.mean()), "max": float(d.max()), "differing": int((d > 0).sum()),
                    "pixels": int(d.size)})
    return out
