"""In-rank MoE forward check for test_moe_ep.py: the forward context's ``dp_metadata`` at the MoE layer,
and vLLM's own all2all dispatch/combine run with it.

Runs inside a rank of :func:`support.ep_world.run_worlds` after a worker-style init (groups built), within
the worker's ``set_current_vllm_config``. Per MoE forward, the way omni's HunyuanImage3 pipeline does it:

* ``vllm.forward_context.set_forward_context(None, vllm_config)`` (REAL vLLM) with the worker's vLLM config,
  which the pipeline captures at construction; no ``num_tokens``, so vLLM makes no ``dp_metadata`` itself;
* the REAL ``HunyuanFusedMoEDefault`` of the wheel (``hunyuan_fused_moe.py``, imported as is, so the patch's
  import hook sees it) called like the MoE block calls it, ``experts(hidden_states=..., router_logits=...)``,
  twice in one context (two MoE layers). What runs is omni's own code around the layer: 0.24.0's pre-hooks
  (``_set_forward_context_num_tokens`` + ``_set_forward_context_dp_metadata``), 0.24.0rc1's pre-hook,
  0.20/0.22's ``forward`` (num_tokens, then ``super().forward``), 0.18's ``forward``;
* where vLLM's MoE runner would run (``FusedMoE``: its ``forward`` on 0.18-0.22, the ``FusedMoE(...)`` factory's
  runner on 0.24), a stand-in that records the context's ``dp_metadata`` and then does what the runner's naive
  DP dispatch does around the experts: inside ``dp_metadata.sp_local_sizes(1)`` (MoE sp_size 1 here), REAL
  ``get_ep_group().dispatch_router_logits(hidden, logits, False)`` -> identity experts ->
  ``get_ep_group().combine(...)``: vLLM's CPU communicator and all2all manager (AllGather-ReduceScatter on
  vLLM 0.20-0.24, Naive on 0.18), the manager's ``assert dp_metadata is not None`` and size checks included.

What cannot run on CPU: vLLM's CPU communicator has no ``all_gatherv`` / ``reduce_scatterv`` (the base class
raises ``NotImplementedError``; CUDA does them with NCCL), which the AllGather-ReduceScatter manager calls
with the per-DP-rank sizes from ``dp_metadata``. ``support.cpu_moe_standins.cpu_variable_collectives`` supplies both over gloo
(pad to the largest size, all-gather, trim; all-reduce, keep this rank's rows) and records each call's group
and sizes. Everything before and after them is vLLM's. The expert kernels themselves are not run (identity).
"""
from __future__ import annotations

import importlib
from contextlib import nullcontext

from support.cpu_moe_standins import cpu_variable_collectives

HIDDEN = 4
EXPERTS = 2


def tensor_fact(t) -> dict | None:
    if t is None:
        return None
    return {"dtype": str(t.dtype), "shape": list(t.shape), "values": t.tolist()}


def dp_metadata_facts(md) -> dict | None:
    """Every dataclass field of vLLM's ``DPMetadata`` plus what vLLM derives from it for dispatch."""
    if md is None:
        return None
    import dataclasses

    import torch

    out: dict = {"class": f"{type(md).__module__}.{type(md).__qualname__}"}
    for f in dataclasses.fields(md):
        v = getattr(md, f.name)
        out[f.name] = tensor_fact(v) if isinstance(v, torch.Tensor) else v
    out["cu_tokens_across_sp(1)"] = tensor_fact(md.cu_tokens_across_sp(1))
    with md.sp_local_sizes(1) as sizes:
        out["sp_local_sizes(1)"] = list(sizes)
    return out


def dispatch_combine(hidden, logits) -> dict:
    """vLLM's naive DP dispatch around identity experts, as its MoE runner does it (see module doc)."""
    import vllm.distributed.parallel_state as vps
    import vllm.forward_context as vfc

    calls: list = []
    md = vfc.get_forward_context().dp_metadata
    out: dict = {"collectives": calls}
    try:
        ep = vps.get_ep_group()
        with cpu_variable_collectives(calls), (md.sp_local_sizes(1) if md is not None else nullcontext()):
            h, lg = ep.dispatch_router_logits(hidden, logits, False)
            out["dispatched_hidden"], out["dispatched_logits"] = tensor_fact(h), tensor_fact(lg)
            out["combined"] = tensor_fact(ep.combine(h.clone(), False))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _layer(mod, runner_forward):
    """The real ``HunyuanFusedMoEDefault`` with ``runner_forward`` where vLLM's MoE runner would run.
    Returns (layer, patcher) -- the patcher keeps the stand-in in place while the layer is used."""
    from unittest import mock

    import torch

    cls = mod.HunyuanFusedMoEDefault
    if isinstance(cls, type) and issubclass(cls, torch.nn.Module):  # 0.18-0.22: a FusedMoE subclass
        base = cls.__mro__[1]  # FusedMoE (SharedFusedMoE on 0.18): its forward is vLLM's runner entry
        patcher = mock.patch.object(base, "forward", lambda self, hidden_states, router_logits:
                                    runner_forward(hidden_states, router_logits))
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)  # vLLM's FusedMoE.__init__ (weights, quant method) is not needed here
        return layer, patcher

    class Runner(torch.nn.Module):  # 0.24: what the FusedMoE(...) factory returns
        quant_method = None

        def forward(self, hidden_states, router_logits):
            return runner_forward(hidden_states, router_logits)

    patcher = mock.patch("vllm.model_executor.layers.fused_moe.FusedMoE", lambda **kwargs: Runner())
    with patcher:
        layer = cls(prefix="model.layers.0.mlp.experts", num_experts=64, top_k=8, hidden_size=HIDDEN,
                    intermediate_size=8, reduce_results=False)  # the real __new__ registers its pre-hooks
    return layer, nullcontext()


def forward_checks(omni_version: str, num_tokens: int, rank: int) -> dict:
    """dp_metadata and dispatch without the omni layer (vLLM's runner straight away) and through it."""
    import torch
    import vllm.forward_context as vfc
    from vllm.config import get_current_vllm_config

    from patches.moe_ep_parallel_mapping.moe_ep_scenarios import fused_moe_module_name

    vllm_config = get_current_vllm_config()  # the pipeline's self.vllm_config
    hidden = torch.arange(num_tokens * HIDDEN, dtype=torch.float32).reshape(num_tokens, HIDDEN) + 1000 * rank
    logits = torch.arange(num_tokens * EXPERTS, dtype=torch.float32).reshape(num_tokens, EXPERTS) - 1000 * rank
    out: dict = {"num_tokens": num_tokens}
    with vfc.set_forward_context(None, vllm_config):
        out["context_dp_metadata"] = dp_metadata_facts(vfc.get_forward_context().dp_metadata)
        out["without_layer"] = dispatch_combine(hidden, logits)

    mod = importlib.import_module(fused_moe_module_name(omni_version))
    seen: list = []

    def runner_forward(hidden_states, router_logits):
        seen.append(vfc.get_forward_context().dp_metadata)
        return dispatch_combine(hidden_states, router_logits)

    layer, patcher = _layer(mod, runner_forward)
    with patcher, vfc.set_forward_context(None, vllm_config):
        first = layer(hidden_states=hidden, router_logits=logits)
        second = layer(hidden_states=hidden, router_logits=logits)  # the next MoE layer, same forward
    out["dp_metadata"] = dp_metadata_facts(seen[0])
    out["second_layer_reuses_metadata"] = seen[0] is not None and seen[1] is seen[0]
    out["dispatch"], out["dispatch_second_layer"] = first, second

    # Failure injection: the token-count gather raises on every rank. The patch must leave the layer running
    # as stock does (no metadata; vLLM's own assert then speaks); 0.24.0's hook lets the error out.
    from unittest import mock

    seen.clear()
    with patcher, vfc.set_forward_context(None, vllm_config), \
            mock.patch("torch.distributed.all_gather_object", side_effect=RuntimeError("injected gather failure")):
        try:
            result = layer(hidden_states=hidden, router_logits=logits)
            out["gather_fails"] = {"dp_metadata": dp_metadata_facts(seen[0]) if seen else "runner not reached",
                                   "dispatch_error": result.get("error")}
        except Exception as exc:
            out["gather_fails"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
