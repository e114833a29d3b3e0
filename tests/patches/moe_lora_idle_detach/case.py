"""Contract case for moe-lora-idle-detach, and the scenarios its test runs: the REAL DiffusionLoRAManager.

What is real: vllm-omni's diffusion LoRA package (``manager.py``, ``utils.py``, ``layers/*``), its
``diffusion/offloader/config.py`` and ``lora/utils.py``, byte for byte from the PyPI wheel; torch (CPU). What is a
stand-in (:class:`~omni_patches.testing.Release` ``standins``, the one mechanism):

* the vLLM LoRA layers and helpers the manager imports (:data:`STANDINS`): vLLM's ``FusedMoEWithLoRA`` runs its
  fused-MoE LoRA kernels (punica / Triton), which do not run on CPU. Ours keeps what the manager and the patch read:
  the stacked weights, ``adapter_enabled``, and where ``set_mapping`` sends the MoE-LoRA context -- to the runner's
  ``set_lora_context`` when it has one (as vllm-ascend's ``AscendFusedMoEWithLoRA`` does), otherwise to its own
  modular kernel (vLLM's GPU wrapper: ``gpu_experts``);
* vllm-ascend: its dist-info alone (the patch's gate reads it; ``ascend=None`` leaves it out). Its MoE runner is the
  scenarios' ``AscendLikeMoERunner``: ``set_lora_context`` into ``_ascend_moe_lora_context``, as ``AscendFusedMoE``
  does, counting forwards that ran with a context (the per-forward LoRA work on NPU);
* every other import the real files make: permissive.

The scenarios (:func:`lifecycle`, :func:`runner_refuses_none`) are module-level functions that import nothing of the
release until they run in its child (``Release.call``, the contract's ``drive``).
"""
import functools

from omni_patches.testing import VLLM_LOGGER, Case, Env, Release, Unexpected

PATCH_ID = "moe-lora-idle-detach"
MANAGER = "vllm_omni/diffusion/lora/manager.py"
FILES = ["vllm_omni/diffusion/lora/__init__.py", MANAGER, "vllm_omni/diffusion/lora/utils.py",
         "vllm_omni/diffusion/lora/layers/__init__.py", "vllm_omni/diffusion/lora/layers/base_linear.py",
         "vllm_omni/diffusion/lora/layers/column_parallel_linear.py",
         "vllm_omni/diffusion/lora/layers/replicated_linear.py",
         "vllm_omni/diffusion/lora/layers/row_parallel_linear.py",
         "vllm_omni/diffusion/offloader/config.py", "vllm_omni/lora/utils.py"]
ASCEND = "0.30.0rc2"  # the vllm-ascend the dist-info names (the newest release, built for vLLM 0.30.0)

# -- stand-ins (our own minimal code, not vLLM's) ------------------------------------------------------------------
LORA_LAYERS = '''
import dataclasses
from typing import Any

import torch
import torch.nn as nn


@dataclasses.dataclass
class LoRAMapping:
    index_mapping: tuple
    prompt_mapping: tuple
    is_prefill: bool = False


class BaseLayerWithLoRA(nn.Module):
    punica_wrapper: Any = None

    def set_mapping(self, punica_wrapper) -> None:
        self.punica_wrapper = punica_wrapper

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return False  # dense LoRA layers are never selected here


class BaseLinearLayerWithLoRA(BaseLayerWithLoRA):
    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer


class ColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA): pass
class MergedColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA): pass
class QKVParallelLinearWithLoRA(BaseLinearLayerWithLoRA): pass
class MergedQKVParallelLinearWithLoRA(BaseLinearLayerWithLoRA): pass
class ReplicatedLinearWithLoRA(BaseLinearLayerWithLoRA): pass
class RowParallelLinearWithLoRA(BaseLinearLayerWithLoRA): pass


@dataclasses.dataclass
class MoELoRAContext:
    """What the wrappers publish: stable references to the LoRA stacks, enablement and mapping."""

    w13_lora_a_stacked: tuple
    w13_lora_b_stacked: tuple
    w2_lora_a_stacked: tuple
    w2_lora_b_stacked: tuple
    adapter_enabled: torch.Tensor
    max_loras: int
    top_k: int
    local_num_experts: int
    punica_wrapper: Any
    owner: Any = dataclasses.field(default=None, repr=False)


class GpuFusedExperts:
    """Plays ``FusedMoEWithLoRA._moe_kernel.fused_experts`` on the GPU path (its context is required there)."""

    def __init__(self) -> None:
        self.lora_context, self.calls = None, []

    def set_lora_context(self, ctx) -> None:
        self.calls.append(ctx)
        self.lora_context = ctx


class FusedMoEWithLoRA(BaseLayerWithLoRA):
    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.tp_size, self.tp_rank = getattr(base_layer, "tp_size", 1), getattr(base_layer, "tp_rank", 0)
        self.moe_config = base_layer.moe_config
        self._w13_slices = 2 if getattr(base_layer.moe_config, "is_act_and_mul", True) else 1
        self.enable_moe_shared_loras = False
        self.device = torch.device("cpu")
        self.gpu_experts = None if callable(getattr(base_layer, "set_lora_context", None)) else GpuFusedExperts()

    # read by DiffusionLoRAManager._bind_moe_adapter_weights / _bind_adapter_weights
    local_num_experts = property(lambda self: self.base_layer.local_num_experts)
    global_num_experts = property(lambda self: self.base_layer.global_num_experts)
    use_ep = property(lambda self: self.base_layer.use_ep)
    ep_rank = property(lambda self: self.base_layer.ep_rank)
    hidden_size = property(lambda self: self.base_layer.hidden_size)
    intermediate_size_per_partition = property(lambda self: self.base_layer.intermediate_size_per_partition)

    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        self.max_loras, self.max_lora_rank = lora_config.max_loras, lora_config.max_lora_rank
        e, h, i, r = (self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition,
                      lora_config.max_lora_rank)
        self.adapter_enabled = torch.zeros(max_loras + 1, dtype=torch.int)
        self.w13_lora_a_stacked = tuple(torch.zeros(max_loras, e, r, h) for _ in range(self._w13_slices))
        self.w13_lora_b_stacked = tuple(torch.zeros(max_loras, e, i, r) for _ in range(self._w13_slices))
        self.w2_lora_a_stacked = (torch.zeros(max_loras, e, r, i),)
        self.w2_lora_b_stacked = (torch.zeros(max_loras, e, h, r),)

    def _stacks(self):
        return (*self.w13_lora_a_stacked, *self.w13_lora_b_stacked, *self.w2_lora_a_stacked, *self.w2_lora_b_stacked)

    def reset_lora(self, index: int) -> None:
        for t in self._stacks():
            t[index] = 0
        self.adapter_enabled[index] = 0

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        assert isinstance(lora_a, list) and isinstance(lora_b, list) and len(lora_a) == len(lora_b) == 3
        self.reset_lora(index)
        self.adapter_enabled[index] = 1
        (w1a, w2a, w3a), (w1b, w2b, w3b) = lora_a, lora_b
        r = w1a.shape[1]
        self.w13_lora_a_stacked[0][index, :, :r].copy_(w1a)
        self.w13_lora_b_stacked[0][index, :, :, :r].copy_(w1b)
        if self._w13_slices == 2:
            self.w13_lora_a_stacked[1][index, :, :r].copy_(w3a)
            self.w13_lora_b_stacked[1][index, :, :, :r].copy_(w3b)
        self.w2_lora_a_stacked[0][index, :, :r].copy_(w2a)
        self.w2_lora_b_stacked[0][index, :, :, :r].copy_(w2b)

    def set_mapping(self, punica_wrapper) -> None:
        BaseLayerWithLoRA.set_mapping(self, punica_wrapper)
        ctx = MoELoRAContext(self.w13_lora_a_stacked, self.w13_lora_b_stacked, self.w2_lora_a_stacked,
                             self.w2_lora_b_stacked, self.adapter_enabled, self.max_loras,
                             getattr(self.base_layer, "top_k", 1), self.local_num_experts, punica_wrapper, owner=self)
        (self.gpu_experts or self.base_layer).set_lora_context(ctx)

    def forward(self, *args, **kwargs):
        return self.base_layer(*args, **kwargs)


class FusedMoE3DWithLoRA(FusedMoEWithLoRA):
    pass
'''

PUNICA = '''
import torch


class StandInPunicaWrapper:
    """Keeps the host-side facts the MoE paths read: ``no_lora`` and the token -> slot indices."""

    def __init__(self, max_num_batched_tokens, max_batches, device, **kwargs) -> None:
        self.max_num_batched_tokens, self.device = max_num_batched_tokens, device
        self.no_lora = False  # vLLM's PunicaWrapperBase default; only prefill metadata recomputes it
        self.is_prefill = False
        self.token_lora_indices = torch.full((max_num_batched_tokens,), -1, dtype=torch.long)

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs) -> None:
        slots = [lora_index_to_id.index(i) if i > 0 and i in lora_index_to_id else -1 for i in mapping.index_mapping]
        self.token_lora_indices[: len(slots)] = torch.tensor(slots, dtype=torch.long)
        self.is_prefill = bool(mapping.is_prefill)
        if self.is_prefill:
            self.no_lora = all(s == -1 for s in slots)


def get_punica_wrapper(max_num_batched_tokens, max_batches, device, **kwargs):
    return StandInPunicaWrapper(max_num_batched_tokens, max_batches, device, **kwargs)
'''

LORA_REQUEST = '''
import dataclasses


@dataclasses.dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
'''

PEFT_HELPER = '''
import dataclasses


@dataclasses.dataclass
class PEFTHelper:
    r: int
    lora_alpha: int
    target_modules: object = None
'''

LORA_WEIGHTS = '''
class LoRALayerWeights:
    def __init__(self, module_name, rank, lora_alpha, lora_a, lora_b, scaling=None) -> None:
        self.module_name, self.rank, self.lora_alpha = module_name, rank, lora_alpha
        self.lora_a, self.lora_b = lora_a, lora_b
        self.scaling = lora_alpha / rank if scaling is None else scaling
        self.optimized = False

    def optimize(self):
        if not self.optimized and self.scaling != 1:
            self.lora_b, self.scaling = self.lora_b * self.scaling, 1
        self.optimized = True
        return self


class PackedLoRALayerWeights(LoRALayerWeights):
    pass
'''

LORA_MODEL = '''
class LoRAModel:
    def __init__(self, lora_model_id, rank, loras) -> None:
        self.id, self.rank, self.loras = lora_model_id, rank, loras

    def get_lora(self, module_name):
        return self.loras.get(module_name)
'''

LORA_UTILS = '''
from vllm.model_executor.layers.linear import LinearBase


def get_adapter_absolute_path(path):
    return path


def get_supported_lora_modules(model):
    return sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, LinearBase)})


def replace_submodule(model, module_name, new_module):
    parent_name, _, leaf = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new_module)
    return new_module
'''

LORA_CONFIG = '''
from typing import Literal


class LoRAConfig:
    def __init__(self, max_lora_rank=16, max_loras=1, max_cpu_loras=None, lora_dtype=None,
                 fully_sharded_loras=False, **extra) -> None:
        self.max_lora_rank, self.max_loras, self.max_cpu_loras = max_lora_rank, max_loras, max_cpu_loras
        self.lora_dtype, self.fully_sharded_loras = lora_dtype, fully_sharded_loras
        self.__dict__.update(extra)


MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
'''

STANDINS = {
    "vllm.logger": VLLM_LOGGER,
    # keep it non-"npu": that branch of _select_moe_lora_wrapper_cls imports vllm_ascend's wrapper
    "vllm.platforms": "import types\ncurrent_platform = types.SimpleNamespace(device_type='cuda')",
    "vllm.config.lora": LORA_CONFIG,
    "vllm.lora.request": LORA_REQUEST,
    "vllm.lora.peft_helper": PEFT_HELPER,
    "vllm.lora.lora_weights": LORA_WEIGHTS,
    "vllm.lora.lora_model": LORA_MODEL,
    "vllm.lora.utils": LORA_UTILS,
    "vllm.lora.punica_wrapper": PUNICA,
    "vllm.lora.layers": LORA_LAYERS,
    **{f"vllm.lora.layers.{m}": "from vllm.lora.layers import *" for m in (
        "base", "base_linear", "column_parallel_linear", "replicated_linear", "row_parallel_linear", "fused_moe")},
    "vllm.model_executor.layers.linear": "import torch.nn as nn\n\n\nclass LinearBase(nn.Module): pass\n"
                                         "class MergedColumnParallelLinear(LinearBase): pass\n"
                                         "class QKVParallelLinear(LinearBase): pass\n",
    "vllm.model_executor.layers.fused_moe": "import torch.nn as nn\n\n\nclass MoERunner(nn.Module): pass\n\n\n"
                                            "FusedMoE = MoERunner\n",
}


def release(version="0.32.0rc1", ascend=ASCEND, **kw):
    """The real manager of vllm-omni ``version`` with :data:`STANDINS`; a vllm-ascend ``ascend`` dist-info beside it
    (None: vllm-ascend is not installed)."""
    dists = (Release("vllm-ascend", ascend, real=False),) if ascend else ()
    return Release("vllm-omni", version, files=FILES, standins=STANDINS, auto_standins=True, passthrough=("torch",),
                   with_=dists, label=None if ascend else f"vllm-omni-{version}-no-ascend", **kw)


OMNI = release()
OMNI_032 = OMNI.env("omni-0.32.0rc1")


# -- scenarios (run in a child on the release) ------------------------------------------------------------------
@functools.cache
def world():
    """The scenarios' model: one Ascend-like and one GPU-like MoE runner in a pipeline with the manager's hooks."""
    import types

    import torch
    import torch.nn as nn
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.layers.fused_moe import MoERunner

    class Runner(MoERunner):
        def __init__(self, num_experts=2, hidden_size=8, intermediate_size=16, top_k=1) -> None:
            super().__init__()
            self.moe_config = types.SimpleNamespace(num_experts=num_experts, is_act_and_mul=True)
            self.global_num_experts = self.local_num_experts = num_experts
            self.hidden_size, self.intermediate_size_per_partition, self.top_k = hidden_size, intermediate_size, top_k
            self.tp_size, self.tp_rank, self.use_ep, self.ep_rank = 1, 0, False, 0
            # The real runner has pre-hooks (token counts, NPU comm context); omni asserts they survive.
            self.register_forward_pre_hook(lambda module, args: None)

        def forward(self, hidden_states, router_logits=None):
            return hidden_states

    class AscendLikeMoERunner(Runner):
        """Has ``set_lora_context`` like vllm-ascend's runner; counts forwards that ran the LoRA path."""

        _ascend_moe_lora_context = None

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.lora_context_calls, self.forwards_with_context = [], 0

        def set_lora_context(self, lora_context) -> None:
            self.lora_context_calls.append(lora_context)
            self._ascend_moe_lora_context = lora_context

        @property
        def lora_context(self):
            return self._ascend_moe_lora_context

        def forward(self, hidden_states, router_logits=None):
            if self._ascend_moe_lora_context is not None:
                self.forwards_with_context += 1  # on NPU: argsort routing recovery + two LoRA kernels
            return hidden_states

    class GpuLikeMoERunner(Runner):
        """No ``set_lora_context``: the GPU wrapper's kernel needs its context at all times."""

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe_ascend, self.moe_gpu = AscendLikeMoERunner(), GpuLikeMoERunner()

        def forward(self, x):
            return self.moe_gpu(self.moe_ascend(x))

    class Pipeline(nn.Module):
        """``adapter_ranks`` maps a LoRA path to its rank; adapters cover every expert projection of both runners.
        ``fail_next``: the next activation fails -- ``"merge"`` raises from ``_create_diffusion_merged_lora`` (after
        the MoE context was published), ``"validate"`` from ``_validate_diffusion_lora_binding`` (before)."""

        od_config = None

        def __init__(self, adapter_ranks) -> None:
            super().__init__()
            self.transformer, self.adapter_ranks, self.fail_next = Transformer(), dict(adapter_ranks), None

        def runner(self, cls):
            return next(m for m in self.modules() if type(m) is cls)

        def _load_diffusion_lora_adapter(self, *, lora_request, lora_path, dtype):
            rank = self.adapter_ranks[lora_path]
            gen = torch.Generator().manual_seed(lora_request.lora_int_id)
            loras = {}
            for runner_name in ("moe_ascend", "moe_gpu"):
                runner = getattr(self.transformer, runner_name)
                runner = getattr(runner, "base_layer", runner)
                h, i = runner.hidden_size, runner.intermediate_size_per_partition
                for e in range(runner.global_num_experts):
                    for proj, (fan_in, fan_out) in (("gate_proj", (h, i)), ("up_proj", (h, i)), ("down_proj", (i, h))):
                        name = f"{runner_name}.{e}.{proj}"
                        loras[name] = LoRALayerWeights(name, rank, rank, torch.randn(rank, fan_in, generator=gen),
                                                       torch.randn(fan_out, rank, generator=gen))
            return LoRAModel(lora_request.lora_int_id, rank, loras), PEFTHelper(r=rank, lora_alpha=rank)

        def _validate_diffusion_lora_binding(self, *, lora_model, bound_lora_names):
            if self.fail_next == "validate":
                self.fail_next = None
                raise RuntimeError("injected binding failure")

        def _create_diffusion_merged_lora(self, *, lora_model, modules, scale):
            if self.fail_next == "merge":
                self.fail_next = None
                raise RuntimeError("injected failure after publish")

    return types.SimpleNamespace(AscendLikeMoERunner=AscendLikeMoERunner, GpuLikeMoERunner=GpuLikeMoERunner,
                                 Pipeline=Pipeline)


def _manager(pipe, **kw):
    import torch
    from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager

    return DiffusionLoRAManager(pipe, torch.device("cpu"), torch.float32, max_num_batched_tokens=64, **kw)


def _snapshot(step, mgr, pipe, error=None) -> dict:
    """One step's facts; ``ok``: the patch's post-condition (the Ascend-like runner has a context iff an adapter is
    active)."""
    from vllm.lora.layers import FusedMoEWithLoRA

    ctx = pipe.runner(world().AscendLikeMoERunner).lora_context
    gpu = next((m for m in mgr._lora_modules.values() if isinstance(m, FusedMoEWithLoRA) and m.gpu_experts), None)
    out = dict(step=step, active=mgr._active_adapter_id is not None, ctx=ctx is not None,
               enabled=None if ctx is None else bool(int(ctx.adapter_enabled[0])),
               gpu=None if gpu is None else gpu.gpu_experts.lora_context is not None, error=error)
    out["ok"] = out["ctx"] == out["active"]
    out["line"] = " ".join(f"{k}={v}" for k, v in out.items())
    return out


def _walk(fail_at, eager) -> dict:
    """activate -> deactivate -> idle rank growth -> re-arm -> failed activation -> remove -> close. Adapter A (id 1)
    has rank 8, B (id 2) rank 16: adding B while idle grows the max rank. ``eager``: the wrappers are created (and
    published) inside ``__init__`` with no adapter yet (upstream #9443's pipelines)."""
    import torch
    from vllm.lora.layers import FusedMoEWithLoRA
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest

    req_a, req_b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    pipe = world().Pipeline({req_a.lora_path: 8, req_b.lora_path: 16})
    if eager:
        def bind(mgr):
            if mgr is not None:
                mgr._replace_layers_with_lora(PEFTHelper(r=8, lora_alpha=8))
                mgr._publish_moe_lora_context()
        pipe._bind_diffusion_lora_manager = bind
    mgr = _manager(pipe, max_cached_adapters=2)
    steps, x = [], torch.zeros(4, 8)

    def step(name, fn, forward=True):
        err = None
        try:
            fn()
        except Exception as exc:  # the failed activation raises by design
            err = f"{type(exc).__name__}: {exc}"
        if forward and not mgr._closed:
            pipe.transformer(x)
        steps.append(_snapshot(name, mgr, pipe, err))

    def failing_activation():
        pipe.fail_next = fail_at
        mgr.set_active_adapter(req_b, 1.0)

    step("init (lazy wrapping)", lambda: None)
    step("activate A (r8)", lambda: mgr.set_active_adapter(req_a, 1.0))
    step("deactivate (set_active_adapter None)", lambda: mgr.set_active_adapter(None))
    step("idle add B (r16): max-rank growth", lambda: mgr.add_adapter(req_b))
    step("activate A again (full bind)", lambda: mgr.set_active_adapter(req_a, 1.0))
    step("deactivate", lambda: mgr.set_active_adapter(None))
    step("re-arm suspended A", lambda: mgr.set_active_adapter(req_a, 1.0))
    step(f"activate B fails ({fail_at}) -> rollback", failing_activation)
    step("activate A (full bind)", lambda: mgr.set_active_adapter(req_a, 1.0))
    step("remove active A", lambda: mgr.remove_adapter(1))
    step("activate B", lambda: mgr.set_active_adapter(req_b, 1.0))
    step("close", mgr.close, forward=False)
    gpu_runner = pipe.runner(world().GpuLikeMoERunner)
    return {"steps": steps, "forwards_with_context": pipe.runner(world().AscendLikeMoERunner).forwards_with_context,
            "gpu_set_lora_context": callable(getattr(gpu_runner, "set_lora_context", None)),
            "gpu_calls": sum(len(m.gpu_experts.calls) for m in pipe.modules()
                             if isinstance(m, FusedMoEWithLoRA) and m.gpu_experts is not None)}


def lifecycle(patched: bool) -> dict:
    """Every walk (lazy and eager wrapping, failure at merge and at validate), ``suspended()``, and -- patched -- the
    status reasons before and after use and stock behaviour again after ``unapply``."""
    import omni_patches

    if patched:
        omni_patches.activate(force=True)
    import vllm_omni.diffusion.lora.manager  # noqa: F401  (the target's import applies the patch)
    from vllm.lora.request import LoRARequest

    def reason():
        return {s.id: s for s in omni_patches.status()}[PATCH_ID].reason if patched else None

    out = {"status": {s.id: s for s in omni_patches.status()}[PATCH_ID].state if patched else "off",
           "reason_at_import": reason(),
           "runs": {f"eager={eager} fail={fail_at}": _walk(fail_at, eager)
                    for eager in (False, True) for fail_at in ("merge", "validate")}}
    # suspended(): the base model runs with no context, the adapter comes back re-armed (not republished).
    pipe = world().Pipeline({"/adapters/a": 8})
    runner = pipe.runner(world().AscendLikeMoERunner)
    mgr = _manager(pipe)
    mgr.set_active_adapter(LoRARequest("a", 1, "/adapters/a"), 1.0)
    out["suspended"] = [runner.lora_context is not None]
    with mgr.suspended():
        out["suspended"].append(runner.lora_context is not None)
    out["suspended"].append(runner.lora_context is not None)
    out["reason_after_use"] = reason()
    if patched:
        omni_patches.unapply(PATCH_ID)
        mgr.set_active_adapter(None)
        out["after_unapply_idle_ctx"] = runner.lora_context is not None
    return out


def runner_refuses_none():
    """An Ascend-like runner whose set_lora_context rejects None: stock never detaches, so the manager works; the
    patch's sync fails there, and the manager's calls return as stock's do (the runner keeps its context)."""
    from vllm.lora.request import LoRARequest

    class KeepsContext(world().AscendLikeMoERunner):
        def set_lora_context(self, lora_context):
            if lora_context is None:
                raise TypeError("this runner keeps its MoE-LoRA context")
            super().set_lora_context(lora_context)

    pipe = world().Pipeline({"/adapters/a": 8})
    runner = pipe.transformer.moe_ascend = KeepsContext()
    mgr = _manager(pipe)
    got = [mgr.set_active_adapter(LoRARequest("a", 1, "/adapters/a"), 1.0), mgr.set_active_adapter(None)]
    return [*got, mgr._active_adapter_id, runner.lora_context is not None, len(runner.lora_context_calls)]


CASE = Case(
    patch_id=PATCH_ID,
    affected=[OMNI_032],
    skipped=[
        # No MoE LoRA in the manager before 0.32.0rc1: the version gate says so before anything is imported.
        (release("0.31.0rc1").env("omni-0.31.0rc1"), "skipped:version", "outside"),
        # The real 0.32.0rc1 manager without vllm-ascend (GPU, or this CPU): no runner takes a MoE-LoRA context.
        (release(ascend=None).env("omni-0.32.0rc1-no-ascend"), "skipped:absent", "vllm-ascend is not installed"),
        # A manager that learned to detach by itself: found by feature, not by version.
        (Env.edited("omni-0.32.0rc1-own-detach", OMNI_032, MANAGER,
                    "    def _publish_moe_lora_context(self) -> None:",
                    "    def _detach_moe_lora_context(self) -> None:\n        pass\n\n"
                    "    def _publish_moe_lora_context(self) -> None:"),
         "skipped:version", "fixed upstream"),
    ],
    source_built=[
        (Env.source_build(OMNI_032, "vllm_omni-0.32.0rc1.dist-info/METADATA", "0.32.0rc1", "0.32.0rc2.dev40+gabcdef12"),
         "applied", "is a source build: decided by code features"),
        (Env.source_build(OMNI_032, "vllm_omni-0.32.0rc1.dist-info/METADATA", "0.32.0rc1", "0.0.0"), "applied",
         "decided by code features"),
    ],
    unexpected=[Unexpected(OMNI_032, runner_refuses_none, note="could not sync the MoE-LoRA context")],
    drifted=[
        (Env.edited("omni-0.32.0rc1-renamed", OMNI_032, MANAGER,
                    "def _ensure_max_lora_rank(", "def _ensure_max_lora_rank_v2("), "_ensure_max_lora_rank"),
        (Env.edited("omni-0.32.0rc1-no-publish", OMNI_032, MANAGER,
                    "def _publish_moe_lora_context(", "def _publish_lora_context("), "_publish_moe_lora_context"),
    ],
)


# What `omni-patches audit <release>` says on the real release files, in and just outside the range (tests/test_audit.py
# audits every release named here, alone; the words are omni_patches.tools.audit's). In range, the omni release alone
# lacks vllm-ascend: "absent"; with a real vllm-ascend beside it, "would apply" (test_audit.py's
# test_real_ascend_sdist_0_23_with_omni_0_32).
VERDICTS = {
    "vllm-omni==0.22.0": "skip: out of range", "vllm-omni==0.24.0": "skip: out of range",
    "vllm-omni==0.28.0": "skip: out of range", "vllm-omni==0.30.0": "skip: out of range",
    "vllm-omni==0.32.0rc1": "absent",
}
