"""One vllm-ascend release, in a fresh interpreter (``ascend_real.run``): what ``ascend-moe-skip-idle-lora`` does
to its REAL MoE runner, driven by REAL punica wrappers.

Run as ``from patches.ascend_moe_skip_idle_lora.ascend_skip_child import main; main()`` with ``$SKIP_CASE``
(JSON) naming the layout:
``{"module", "cls", "method", "setter": "module.Class", "routed": bool}``: ``setter`` is the class whose real
``set_lora_context`` attaches the context; ``routed``: it stores it on a ``routed_experts`` child, which is the
object the patched method runs on when ``cls`` is that child's class (``AscendRoutedExperts``, 0.27.1rc1+). Prints one ``RESULT {json}`` line.

What runs for real: the release's runner class and method, its ``set_lora_context`` (so the real code decides
where the context lives), vLLM's ``MoELoRAContext`` dataclass, vLLM's ``LoRAMapping`` and the punica wrappers'
own ``update_metadata``: the release's ``PunicaWrapperNPU`` and vLLM's ``PunicaWrapperCPU`` (and
``PunicaWrapperGPU`` when it imports). Instances are made with ``__new__`` + ``nn.Module.__init__`` (their real
constructors need a model config and NPU kernels). To see what the real method sees, its module-global
``get_forward_context`` (the first thing every layout calls; 0.23's ``AscendFusedMoE.forward_impl`` first
asserts ``quant_method``) is replaced by a probe that records the context on the holder at that moment and
raises: every forward here ends in an exception, so every forward also checks the restore-on-raise path.

Three variants of the same method on the same inputs: ``stock`` (the original function), ``naive`` (a gate on
``punica_wrapper.no_lora`` alone: the previous version of this patch, written here in four lines) and
``patched`` (what the shim installed).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import typing

KEY = "_ascend_moe_lora_context"
PATCH_ID = "ascend-moe-skip-idle-lora"

# (label, index_mapping, prompt_mapping, lora_index_to_id, is_prefill): applied in this order on one wrapper.
SEQUENCE = [
    ("no-LoRA prefill", (0, 0, 0, 0), (0,), [1, None], True),
    ("decode with adapter tokens after a no-LoRA prefill", (1, 1, 0, 0), (1, 0), [1, None], False),
    ("prefill with adapter tokens", (1, 1, 0, 0), (1, 0), [1, None], True),
    ("no-LoRA decode after a LoRA prefill", (0, 0, 0, 0), (0,), [1, None], False),
    ("no-LoRA prefill again", (0, 0, 0, 0), (0,), [1, None], True),
    ("omni diffusion mapping (every token on slot 0's adapter, is_prefill=False)", (1, 1, 1, 1), (1,), [1], False),
]
# vllm-omni's diffusion manager: its own wrapper, only ever updated with this mapping.
OMNI_ONLY = [("omni diffusion mapping on a fresh wrapper", (1, 1, 1, 1), (1,), [1], False)]


class Stop(Exception):
    pass


def _wrappers():
    """{label: class} of the real punica wrappers this release and its vLLM provide (import errors reported)."""
    found, errors = {}, {}
    for label, mod, name in (("ascend PunicaWrapperNPU", "vllm_ascend.lora.punica_npu", "PunicaWrapperNPU"),
                             ("vllm PunicaWrapperCPU", "vllm.lora.punica_wrapper.punica_cpu", "PunicaWrapperCPU"),
                             ("vllm PunicaWrapperGPU", "vllm.lora.punica_wrapper.punica_gpu", "PunicaWrapperGPU")):
        try:
            found[label] = getattr(importlib.import_module(mod), name)
        except Exception as exc:  # GPU's needs triton kernels on some versions
            errors[label] = f"{type(exc).__name__}: {exc}"[:300]
    return found, errors


def _lora_config():
    try:
        from vllm.config import LoRAConfig

        return LoRAConfig(max_lora_rank=8, max_loras=2)
    except Exception:
        return None


def _context(pw):
    """vLLM's real MoELoRAContext around ``pw`` (tiny tensors; the forward is stopped before it reads them)."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts.lora_context import MoELoRAContext

    try:
        hints = typing.get_type_hints(MoELoRAContext)
    except Exception:
        hints = {}
    values = {}
    for f in dataclasses.fields(MoELoRAContext):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        hint = hints.get(f.name)
        if f.name == "punica_wrapper":
            values[f.name] = pw
        elif f.name == "adapter_enabled":
            values[f.name] = torch.ones(2, dtype=torch.int32)
        elif hint is bool:
            values[f.name] = False
        elif hint is int:
            values[f.name] = 1
        elif "stacked" in f.name:
            values[f.name] = (torch.zeros(1, 1, 1, 1),)
        else:
            values[f.name] = None
    return MoELoRAContext(**values)


def main():
    import torch.nn as nn

    import omni_patches

    case = json.loads(os.environ["SKIP_CASE"])
    omni_patches.activate(force=True)
    from vllm.lora.layers import LoRAMapping

    from support.ascend_real import disable_pinned_memory

    disable_pinned_memory()

    mod = importlib.import_module(case["module"])
    cls = getattr(mod, case["cls"])
    smod, _, sname = case["setter"].rpartition(".")
    setter_cls = getattr(importlib.import_module(smod), sname)
    st = {s.id: s for s in omni_patches.status()}[PATCH_ID]
    patched = vars(cls)[case["method"]]
    original = getattr(patched, "__wrapped__", patched)
    out = {"state": st.state, "reason": st.reason, "marker": getattr(patched, "__omni_patch__", None),
           "signature": str(__import__("inspect").signature(patched)),
           "same_signature": str(__import__("inspect").signature(patched))
           == str(__import__("inspect").signature(original)),
           "probe_point": "get_forward_context" in original.__code__.co_names}

    def bare(klass):
        obj = klass.__new__(klass)
        nn.Module.__init__(obj)
        return obj

    seen = []

    def probe(*args, **kwargs):
        seen.append(holder.__dict__.get(KEY))
        raise Stop

    original.__globals__["get_forward_context"] = probe

    def naive(self, **kwargs):  # the gate on no_lora alone
        d = holder.__dict__
        lc = d.get(KEY)
        if lc is not None and lc.punica_wrapper.no_lora is True:
            d[KEY] = None
            try:
                return original(self, **kwargs)
            finally:
                d[KEY] = lc
        return original(self, **kwargs)

    variants = {"stock": lambda obj, **kw: original(obj, **kw), "naive": naive,
                "patched": lambda obj, **kw: getattr(obj, case["method"])(**kw)}
    wrappers, errors = _wrappers()
    out["wrapper_errors"] = errors
    from omni_patches.patches import ascend_moe_skip_idle_lora as patch

    out["kinds"] = {label: patch.freshness(wcls) for label, wcls in wrappers.items()}
    out["runs"] = {}
    for (wlabel, wcls), (sequence, suffix) in [(w, s) for w in wrappers.items()
                                               for s in ((SEQUENCE, ""), (OMNI_ONLY, " (omni only)"))]:
        try:
            pw = wcls(8, 4, "cpu", lora_config=_lora_config())
        except Exception as exc:  # vLLM's GPU wrapper wants CUDA-side metadata on some versions
            errors[wlabel + suffix] = f"construct: {type(exc).__name__}: {exc}"[:300]
            continue
        ctx = _context(pw)
        # The runner object and where the real set_lora_context puts the context.
        if case["routed"]:
            runner = bare(setter_cls)
            runner.routed_experts = bare(cls) if setter_cls is not cls else nn.Module()
            runner.__dict__.setdefault("ascend_shared_experts", None)
            setter_cls.set_lora_context(runner, ctx)
            holder = runner.routed_experts
            obj = runner.routed_experts if setter_cls is not cls else runner
        else:
            obj = bare(cls)
            setter_cls.set_lora_context(obj, ctx)
            holder = obj
        try:
            obj.quant_method = object()  # 0.23's forward_impl asserts it before anything else
        except AttributeError:
            pass
        assert holder.__dict__.get(KEY) is ctx, "the real set_lora_context put the context elsewhere"
        steps = []
        for label, index, prompt, ids, prefill in sequence:
            pw.update_metadata(LoRAMapping(index, prompt, is_prefill=prefill), ids, 2, 32000)
            step = {"step": label, "no_lora": pw.no_lora, "is_prefill": pw.is_prefill}
            for vname, call in variants.items():
                seen.clear()
                try:
                    call(obj, hidden_states=None, router_logits=None)
                    step[vname] = "returned"
                except Stop:
                    step[vname] = "saw context" if seen and seen[0] is ctx else "context hidden"
                step[f"{vname} restored"] = holder.__dict__.get(KEY) is ctx
            steps.append(step)
        out["runs"][wlabel + suffix] = steps
    out["final_reason"] = {s.id: s for s in omni_patches.status()}[PATCH_ID].reason  # with the wrapper notes
    print("RESULT " + json.dumps(out))
