"""In-rank scenarios for test_moe_ep.py (run by :func:`support.ep_world.run_worlds`).

Real in every rank: omni's ``parallel_state.py`` / ``group_coordinator.py`` (see ep_world), vLLM's
``parallel_state`` and ``FusedMoEParallelConfig.make`` over gloo, the omni-patches engine and the patch.

Model side (ours around real code; the modules are written into the release by ep_sandbox.py and filled here): the
module ``...hunyuan_image3(_3).hunyuan_image3(_3)_transformer`` is a stand-in that holds the REAL ``HunYuanSparseMoeBlock`` class, its source cut out of the wheel's file with
``ast`` and executed next to small fakes (``ReplicatedLinear``, ``HunYuanMLP``, configs) and a
``HunyuanFusedMoE`` recorder that computes, like vLLM's ``FusedMoE.__init__``, ``pcp = pcp_size or
get_pcp_group().world_size`` and the real ``FusedMoEParallelConfig.make``. The real file cannot import
here (diffusers, torchvision, ...). Likewise ``vllm_omni.platforms.npu.models.hunyuan_fused_moe`` holds the
REAL ``_init_mc2_group_for_diffusion`` (source from the wheel) with the real vLLM
``init_model_parallel_group``; ``vllm_ascend.distributed.parallel_state`` is an in-memory stand-in holding ``_MC2``
(the real NPU file imports torch_npu/vllm_ascend). The non-NPU ``...hunyuan_fused_moe`` module is the wheel's
REAL file, imported as is (ep_moe_forward.py drives it). For test_moe_ep_numeric.py
(``install_model_standins(real_layers=True)``) the transformer stand-in instead holds the real ``HunYuanMLP`` and
``HunYuanSparseMoeBlock`` over vLLM's real layers and the wheel's real ``HunyuanFusedMoE`` (no fakes, no recorder).
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import sys
import time
import types

PATCH_ID = "moe-ep-parallel-mapping"
NPU_MOD = "vllm_omni.platforms.npu.models.hunyuan_fused_moe"
MOE_FIELDS = ("use_ep", "ep_size", "ep_rank", "tp_size", "tp_rank", "dp_size", "dp_rank", "pcp_size", "pcp_rank")


# -- the phases of test_moe_ep.py's worlds (one world per release and role, ep_runs.py) --
_EP = dict(ep=True, moe=True, equiv=True)
# issue 10's worlds (8 ranks each), EP on and is_moe; "sp" is the Ulysses degree, "ring" the ring degree.
WORLDS = [
    # pretend_ascend: the init sees vllm-ascend 0.18.0 installed, context parallel off (the patch must warn)
    dict(label="tp4-u2", tp=4, sp=2, model=True, reinit=True, pretend_ascend="0.18.0", **_EP),
    # SP > 1 with CFG·DP > 1: mapped where vllm-ascend is installed (pretend_ascend 0.21.0, no context-parallel
    # switch needed); off Ascend the patch keeps stock's groups (vLLM's combine order: test_moe_ep_numeric.py)
    dict(label="tp2-u2-cfg2", tp=2, sp=2, cfg=2, forward=True, pretend_ascend="0.21.0", **_EP),
    dict(label="tp2-r2-cfg2", tp=2, ring=2, cfg=2, pretend_ascend="0.21.0", **_EP),
    dict(label="tp8", tp=8, **_EP),
    dict(label="tp2-u2-dp2", tp=2, sp=2, dp=2, forward=True, pretend_ascend="0.21.0", **_EP),
    dict(label="tp2-pp2-cfg2", tp=2, pp=2, cfg=2, **_EP),
    dict(label="hsdp4x2", fs=4, replicate=2, **_EP),  # standalone HSDP: omni lays fs x replicate out as dp
]
# Where the patch must do nothing: compared with stock 0.22.0, not with 0.24.0 (which changed these itself).
UNTOUCHED = [
    dict(label="ep-off", tp=4, sp=2, ep=False, moe=True, model=True, equiv=True),
    dict(label="non-moe-ep", tp=4, sp=2, ep=True, moe=False, equiv=True),
    # vLLM DP (omni's own dp group) > 1 but no mapping: the MoE forward must stay stock
    dict(label="ep-off-dp2", tp=2, sp=2, dp=2, ep=False, moe=True, equiv=True, forward=True),
]
# The patch cannot build vLLM's EP group (after PCP/TP/DP were built): everything must be stock again.
FALLBACK = dict(label="fallback-tp4-u2", tp=4, sp=2, model=True, fail_group="ep", **_EP)
PHASES = {"patched": WORLDS + UNTOUCHED + [FALLBACK], "upstream": WORLDS, "stock": WORLDS + UNTOUCHED}


def phases_for(role: str) -> list[dict]:
    """The phases of the group-facts world for a release in ``role`` ("patched", "upstream", "stock")."""
    return PHASES[role]


def activate_patch() -> None:
    """setup hook: turn omni-patches on in this rank (the registry is the built-in one)."""
    import omni_patches

    omni_patches.activate(force=True)


STARVED: dict = {}  # starve_rank0_in_mc2: rank 0's seconds in the MC2 constructors


def starve_rank0_in_mc2() -> None:
    """setup hook: rank 0 (the TCPStore server, the slowest rank of a loaded machine) wires the MC2 group's
    meshes last. While it builds them, its building thread runs at nice 19 beside a spinning thread at nice 0,
    both on one CPU (the gloo threads it starts inherit both), so its peers finish the group -- and, unless
    the scenario holds them, destroy it and close the sockets rank 0 still has to read. That was CI's
    "Connection closed by peer" in ``_model_checks``; ``support.ep_world.settle`` is the cure. Rank 0 notes the
    seconds it spent in the MC2 constructors (``STARVED["s"]``)."""
    import os
    import threading
    import traceback

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    real = c10d.new_group

    def new_group(*args, **kwargs):
        if not any(f.name == "_init_mc2_group_for_diffusion" for f in traceback.extract_stack()):
            return real(*args, **kwargs)
        if os.environ.get("RANK") != "0":
            return real(*args, **kwargs)
        cpus, cpu = os.sched_getaffinity(0), min(os.sched_getaffinity(0))
        stop = threading.Event()

        def spin():
            os.sched_setaffinity(0, {cpu})
            while not stop.is_set():
                sum(range(1000))

        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
        os.sched_setaffinity(0, {cpu})
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            STARVED["s"] = STARVED.get("s", 0.0) + time.perf_counter() - t0
            stop.set()
            spinner.join()
            os.sched_setaffinity(0, cpus)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
            except OSError:  # raising it back needs CAP_SYS_NICE; the rank still runs, only slower
                pass

    c10d.new_group = dist.new_group = new_group


def transformer_module_name(omni_version: str) -> str:
    if omni_version.startswith("0.18."):
        return "vllm_omni.diffusion.models.hunyuan_image_3.hunyuan_image_3_transformer"
    return "vllm_omni.diffusion.models.hunyuan_image3.hunyuan_image3_transformer"


def fused_moe_module_name(omni_version: str) -> str:
    """The non-NPU MoE layer module (``HunyuanFusedMoEDefault``): served as the REAL file of the wheel."""
    return transformer_module_name(omni_version).rsplit(".", 1)[0] + ".hunyuan_fused_moe"


def _exec_real(module: types.ModuleType, version: str, real_module: str, names) -> None:
    """Run the sources of ``names`` (classes, functions), cut out of ``real_module``'s file in the vllm-omni wheel,
    in ``module``'s namespace."""
    from omni_patches.testing.releases import real_file

    rel = real_module.replace(".", "/") + ".py"
    text = real_file("vllm-omni", version, rel).read_text()
    nodes = {n.name: n for n in ast.parse(text).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    for name in names:
        if name not in nodes:
            raise LookupError(f"{name} not found in {rel} of vllm-omni {version}")
        exec(compile(ast.get_source_segment(text, nodes[name]), f"<real {name} from {rel}>", "exec"), module.__dict__)


# Set by install_model_standins(real_layers=True): the transformer stand-in then binds vLLM's real layers, the
# wheel's real ``HunYuanMLP`` and the real ``HunyuanFusedMoE`` dispatcher (ep_numeric.py).
REAL_LAYERS = False


def _fill_real_layers(module: types.ModuleType, version: str) -> None:
    """``HunYuanMLP`` and ``HunYuanSparseMoeBlock`` (sources cut from the wheel) over vLLM's real
    ``ReplicatedLinear`` / ``MergedColumnParallelLinear`` / ``RowParallelLinear`` / ``SiluAndMul`` and the wheel's
    real ``hunyuan_fused_moe.HunyuanFusedMoE`` (-> ``HunyuanFusedMoEDefault`` -> vLLM's ``FusedMoE``)."""
    import torch
    from torch import nn
    from vllm.config import get_current_vllm_config
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    fused = importlib.import_module(fused_moe_module_name(version))

    class PretrainedConfig:  # annotations only
        pass

    class QuantizationConfig:
        pass

    module.__dict__.update(torch=torch, nn=nn,
                           get_tensor_model_parallel_world_size=get_tensor_model_parallel_world_size,
                           get_current_vllm_config=get_current_vllm_config, PretrainedConfig=PretrainedConfig,
                           QuantizationConfig=QuantizationConfig, ReplicatedLinear=ReplicatedLinear,
                           MergedColumnParallelLinear=MergedColumnParallelLinear, RowParallelLinear=RowParallelLinear,
                           SiluAndMul=SiluAndMul, HunyuanFusedMoE=fused.HunyuanFusedMoE)
    _exec_real(module, version, transformer_module_name(version), ("HunYuanMLP", "HunYuanSparseMoeBlock"))


def _fill_transformer(module: types.ModuleType, version: str) -> None:
    """The transformer module's stand-in (ep_sandbox.py): the real ``HunYuanSparseMoeBlock`` over fakes and the
    recorder below, or with :data:`REAL_LAYERS` over vLLM's real layers (:func:`_fill_real_layers`)."""
    if REAL_LAYERS:
        return _fill_real_layers(module, version)
    import torch
    from torch import nn
    from vllm.config import get_current_vllm_config
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    class PretrainedConfig:  # annotations only
        pass

    class QuantizationConfig:
        pass

    class ReplicatedLinear(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    class HunYuanMLP(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    class HunyuanFusedMoE:
        """Recorder standing in for the dispatcher: what FusedMoE would compute from these kwargs."""

        calls: list = []

        def __new__(cls, *, prefix: str = "", **kwargs):
            import vllm.distributed.parallel_state as vps
            from vllm.config import get_current_vllm_config
            from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

            rec = {"pcp_size_arg": kwargs.get("pcp_size", "absent")}
            try:
                pcp = kwargs.get("pcp_size")
                pcp = pcp if pcp is not None else vps.get_pcp_group().world_size
                cfg = FusedMoEParallelConfig.make(
                    tp_size_=get_tensor_model_parallel_world_size(), pcp_size_=pcp,
                    dp_size_=vps.get_dp_group().world_size, sp_size_=1,
                    vllm_parallel_config=get_current_vllm_config().parallel_config)
                rec.update({k: getattr(cfg, k) for k in MOE_FIELDS})
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
            HunyuanFusedMoE.calls.append(rec)
            return None

        @classmethod
        def make_expert_params_mapping(cls, *args, **kwargs):
            return []

    module.__dict__.update(torch=torch, nn=nn, get_tensor_model_parallel_world_size=get_tensor_model_parallel_world_size,
                           get_current_vllm_config=get_current_vllm_config, PretrainedConfig=PretrainedConfig, QuantizationConfig=QuantizationConfig,
                           ReplicatedLinear=ReplicatedLinear, HunYuanMLP=HunYuanMLP, HunyuanFusedMoE=HunyuanFusedMoE)
    _exec_real(module, version, transformer_module_name(version), ("HunYuanSparseMoeBlock",))


def _fill_npu(module: types.ModuleType, version: str) -> None:
    """The real ``_init_mc2_group_for_diffusion`` and ``prepare_hunyuan_fused_moe_runtime`` of the wheel, with
    the names they import bound to the real omni/vLLM objects; the vllm-ascend / CANN parts
    (``_select_moe_comm_method``, ``_MoECommMethods``, forward-context attributes) are inert stand-ins."""
    import typing

    import torch
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size, init_model_parallel_group

    import vllm_omni.diffusion.distributed.parallel_state as ops
    from vllm_omni.diffusion.forward_context import get_forward_context

    class MoECommType:  # vllm_ascend.ascend_forward_context.MoECommType (annotations only here)
        pass

    module.__dict__.update(
        torch=torch, Any=typing.Any, vllm_init_model_parallel_group=init_model_parallel_group,
        get_tensor_model_parallel_world_size=get_tensor_model_parallel_world_size,
        get_world_group=ops.get_world_group, get_data_parallel_world_size=ops.get_data_parallel_world_size,
        omni_get_ctx=get_forward_context, MoECommType=MoECommType, _MoECommMethods={},
        _select_moe_comm_method=lambda vllm_config: None,
        _ensure_forward_context_attr=lambda name, annotation, default: None)
    if hasattr(ops, "get_expert_parallel_group_ranks"):  # 0.24.0
        module.get_expert_parallel_group_ranks = ops.get_expert_parallel_group_ranks
    _exec_real(module, version, NPU_MOD, ("_init_mc2_group_for_diffusion", "prepare_hunyuan_fused_moe_runtime"))


def install_model_standins(omni_version: str, *, real_layers: bool = False) -> None:
    """Before the model modules are imported (their stand-ins, ep_sandbox.py, read this): ``real_layers``, the
    transformer stand-in holds real layers (:func:`_fill_real_layers`); the platform names the non-NPU MoE layer;
    ``vllm_ascend.distributed.parallel_state`` (the NPU module's MC2 group, the real one imports torch_npu) is a
    stand-in holding ``_MC2 = None``."""
    global REAL_LAYERS
    from omni_patches.testing import standins

    REAL_LAYERS = real_layers
    platforms = importlib.import_module("vllm_omni.platforms")
    platforms.current_omni_platform.impl_qualnames = {
        "hunyuan_fused_moe": fused_moe_module_name(omni_version) + ".HunyuanFusedMoEDefault"}
    if "vllm_ascend.distributed.parallel_state" not in sys.modules:
        _ASCEND.enter_context(standins.modules({"vllm_ascend.distributed.parallel_state": {"_MC2": None}},
                                               permissive=False))


_ASCEND = contextlib.ExitStack()  # the vllm-ascend stand-in, for the rank's lifetime


def _model_checks(omni_version: str) -> dict:
    """Build the real HunYuanSparseMoeBlock and run the real ``prepare_hunyuan_fused_moe_runtime``, as the
    runtime does when the NPU MoE layer is created (it builds vllm-ascend's MC2 group)."""
    from types import SimpleNamespace

    from patches.moe_ep_parallel_mapping.ep_equivalence import coordinator
    from support.ep_world import settle

    tf = importlib.import_module(transformer_module_name(omni_version))
    npu = importlib.import_module(NPU_MOD)
    vaps = importlib.import_module("vllm_ascend.distributed.parallel_state")
    cfg = SimpleNamespace(num_experts=64, moe_topk=8, intermediate_size=64, moe_intermediate_size=32,
                          hidden_size=32, use_mixed_mlp_moe=0, num_shared_expert=1, hidden_act="silu")
    tf.HunyuanFusedMoE.calls.clear()
    tf.HunYuanSparseMoeBlock(cfg, layer_id=0, prefix="model.layers.0.mlp")
    out = {"fused_moe": tf.HunyuanFusedMoE.calls[-1] if tf.HunyuanFusedMoE.calls else None,
           "fused_moe_binding_layers": _layers(tf.__dict__["HunyuanFusedMoE"])}
    vaps._MC2 = None
    npu.prepare_hunyuan_fused_moe_runtime()
    mc2 = vaps._MC2
    out["mc2"] = coordinator(mc2)
    if "s" in STARVED:
        out["rank0_starved_s"] = round(STARVED["s"], 2)
    settle()  # built and dropped with no collective in between
    if mc2 is not None:
        mc2.destroy()
    vaps._MC2 = None
    return out


def _layers(obj):
    from omni_patches import wrapping

    return wrapping.installed_by(obj)


def phases_scenario(rank: int, world_size: int, params: dict) -> dict:
    """Several worker-style inits in one world: per phase init -> facts (-> model checks) -> destroy ->
    after-destroy facts (-> re-init -> facts -> destroy). ``params``: omni_version, phases (list of dicts
    with tp/sp/ring/cfg/dp/pp/fs/replicate/ep/moe/num_experts, optional ``reinit``, ``model`` and ``equiv``:
    per-rank facts for the equivalence test, see ep_equivalence.py; ``forward``: the MoE
    forward check of ep_moe_forward.py; ``pretend_ascend``: a vllm-ascend version reported
    during the first init), worker_maps_moe_config (the worker sets vLLM PCP/DP itself, as 0.24.0's does)."""
    import omni_patches
    import vllm.distributed.parallel_state as vps

    import vllm_omni.diffusion.distributed.parallel_state as ops
    from patches.moe_ep_parallel_mapping import ep_equivalence as eq
    from support.ep_world import phase_degrees, collect_facts, group_facts, make_od_config, settle
    from vllm_omni.diffusion.worker import diffusion_worker as dw

    out: dict = {"phases": []}
    dw.MAP_MOE_VLLM_CONFIG = bool(params.get("worker_maps_moe_config", False))
    if any(p.get("model") or p.get("equiv") or p.get("forward") for p in params["phases"]):
        install_model_standins(params["omni_version"])
    names = ("_TP", "_PCP", "_DP", "_EP", "_PP")
    first = True
    for phase in params["phases"]:
        rec: dict = {"label": phase.get("label")}
        out["phases"].append(rec)
        d = phase_degrees(phase)
        worker = dw.DiffusionWorker(rank, make_od_config(world_size, phase))
        eq.CAPTURED.clear()
        t0 = time.perf_counter()
        try:
            with _failing_vllm_group(phase.get("fail_group")), pretend_ascend_installed(phase.get("pretend_ascend")):
                worker.init_device(init_dist=first)
        except Exception as exc:
            first = False
            rec["init_error"] = f"{type(exc).__name__}: {exc}"
            settle()
            ops.destroy_model_parallel()  # the original raised half-way: clean up for the next phase
            rec["after_destroy"] = {n: group_facts(getattr(vps, n, None)) for n in names}
            if phase.get("equiv"):
                rec["equiv"] = {"init_error": rec["init_error"], "after_destroy": eq.after_destroy_facts()}
            continue
        first = False
        rec["init_s"] = round(time.perf_counter() - t0, 3)
        all2all = list(eq.CAPTURED)
        with worker.contexts():
            rec["first"] = collect_facts(d)
            rec["patch_ep_ranks"] = _patch_ranks()
            if phase.get("equiv"):
                rec["equiv"] = dict(eq.layout_facts(), all2all=all2all)
            if phase.get("model") or phase.get("equiv"):
                rec["model"] = _model_checks(params["omni_version"])
                if phase.get("equiv"):
                    rec["equiv"].update(fused_moe=rec["model"]["fused_moe"], mc2=rec["model"]["mc2"])
            if phase.get("forward"):
                from patches.moe_ep_parallel_mapping.ep_moe_forward import forward_checks

                # Token counts differ between CFG·DP blocks (cond/uncond prompts, other requests), not
                # within one (TP peers replicate, SP shards are padded alike).
                block = d["tp"] * d["sp"] * d["pp"]
                rec["forward"] = forward_checks(params["omni_version"], 3 + 2 * (rank // block), rank)
        st = {s.id: s for s in omni_patches.status()}.get(PATCH_ID)
        rec["reason_after_init"] = None if st is None else st.reason
        built = {n: getattr(vps, n, None) for n in names}
        settle()
        ops.destroy_model_parallel()
        rec["after_destroy"] = {n: group_facts(getattr(vps, n, None)) for n in names}
        if phase.get("equiv"):
            rec["equiv"]["after_destroy"] = eq.after_destroy_facts()
        rec["built_alive_after_destroy"] = {n: _alive(g) for n, g in built.items()}
        rec["patch_ep_ranks_after_destroy"] = _patch_ranks()
        st = {s.id: s for s in omni_patches.status()}.get(PATCH_ID)
        rec["reason_after_destroy"] = None if st is None else st.reason
        if phase.get("reinit"):
            worker.init_device(init_dist=False)
            with worker.contexts():
                rec["second"] = collect_facts(d)
            settle()
            ops.destroy_model_parallel()
            rec["after_second_destroy"] = {n: group_facts(getattr(vps, n, None)) for n in names}
        rec["phase_s"] = round(time.perf_counter() - t0, 3)
    st = {s.id: s for s in omni_patches.status()}.get(PATCH_ID)
    out["patch"] = None if st is None else {"state": st.state, "reason": st.reason,
                                            "applied_targets": list(st.applied_targets)}
    out["worker_binding_layers"] = _layers(dw.__dict__["initialize_model_parallel"])
    settle()
    ops.destroy_distributed_env()
    return out


def pretend_ascend_installed(version):
    """``omni_patches.versions.installed("vllm-ascend")`` answers ``version`` during the init (CPU worlds have
    no vllm-ascend; the EP patch reads it to warn about vllm-ascend's context-parallel switch)."""
    import os
    from contextlib import ExitStack, nullcontext
    from unittest import mock

    from omni_patches import versions

    if not version:
        return nullcontext()
    real = versions.installed

    def installed(dist):
        return ("vllm-ascend", version) if dist == "vllm-ascend" else real(dist)

    stack = ExitStack()
    stack.enter_context(mock.patch.object(versions, "installed", side_effect=installed))
    stack.enter_context(mock.patch.dict(os.environ))
    os.environ.pop("VLLM_ASCEND_ENABLE_CONTEXT_PARALLEL", None)  # the switch is off
    return stack


def _failing_vllm_group(group_name):
    """Failure injection: vLLM's ``init_model_parallel_group`` raises for ``group_name`` (in every rank, before
    any process group of it is created, so the ranks stay in step); other groups are built as usual."""
    from contextlib import nullcontext
    from unittest import mock

    import vllm.distributed.parallel_state as vps

    if not group_name:
        return nullcontext()
    real = vps.init_model_parallel_group

    def init_model_parallel_group(*args, **kwargs):
        if kwargs.get("group_name") == group_name:
            raise RuntimeError(f"injected: cannot build the {group_name!r} group")
        return real(*args, **kwargs)

    return mock.patch.object(vps, "init_model_parallel_group", side_effect=init_model_parallel_group)


def _alive(g):
    if g is None:
        return None
    return getattr(g, "cpu_group", None) is not None or getattr(g, "device_group", None) is not None


def _patch_ranks():
    mod = sys.modules.get("omni_patches.patches.moe_ep_parallel_mapping")
    if mod is None:
        return None
    from omni_patches import engine

    return mod.get_expert_parallel_group_ranks(engine.run(mod.PATCH_ID))
