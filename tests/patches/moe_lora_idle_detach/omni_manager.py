"""Run the REAL ``vllm_omni.diffusion.lora.manager`` (0.32.0rc1) without vLLM.

The real omni files come from the cached PyPI wheel (``support.wheels``):
``diffusion/lora/{__init__,manager,utils}.py``, ``diffusion/lora/layers/*``,
``diffusion/offloader/config.py`` and ``lora/utils.py``. Their package
``__init__`` files above them (``vllm_omni``, ``vllm_omni.diffusion``,
``vllm_omni.diffusion.offloader``, ``vllm_omni.lora``) are replaced by empty
packages whose ``__path__`` points into the wheel, so only those leaf files
load. Every ``vllm.*`` name they import is a small stand-in written here (ours,
not upstream code); ``transformers`` is stubbed only when it is not installed.

Usage::

    with omni_sandbox() as sb:              # installs the modules into sys.modules
        trace = run_lifecycle(sb)           # walks the adapter lifecycle
    # sys.modules is restored on exit; keep everything you need inside the block

``sb.manager_module`` is the real module, ``sb.DiffusionLoRAManager`` the real class.
Wrapping ``sb.DiffusionLoRAManager`` methods (e.g. with wrapt) inside the block is
how a runtime patch is exercised against real upstream code.

Stand-in behaviour that matters for the idle MoE-LoRA context:

* ``FusedMoEWithLoRA.set_mapping(punica)`` records ``punica_wrapper`` and then,
  like Ascend's ``AscendFusedMoEWithLoRA``, calls ``base_layer.set_lora_context(ctx)``
  when the runner has that method; otherwise, like vLLM's GPU wrapper, hands the
  context to its modular kernel's ``fused_experts`` (``wrapper.gpu_experts``).
* ``AscendLikeMoERunner`` stores the context in ``_ascend_moe_lora_context`` (the
  attribute vllm-ascend's ``AscendFusedMoE.set_lora_context`` uses) and counts
  forwards that ran with a context attached (the per-forward LoRA work on NPU).
* ``GpuLikeMoERunner`` has no ``set_lora_context``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from support import wheels

OMNI_VERSION = "0.32.0rc1"

_REAL_PACKAGE_DIRS = {
    # module name -> directory inside the wheel used as the (empty) package's __path__
    "vllm_omni": "vllm_omni",
    "vllm_omni.lora": "vllm_omni/lora",
    "vllm_omni.diffusion": "vllm_omni/diffusion",
    "vllm_omni.diffusion.offloader": "vllm_omni/diffusion/offloader",
}
_STUB_ROOTS = ("vllm", "vllm_omni", "transformers")


# --------------------------------------------------------------------------------------
# vLLM stand-ins (our own minimal code)
# --------------------------------------------------------------------------------------
class LoRAConfig:
    def __init__(self, max_lora_rank: int = 16, max_loras: int = 1, max_cpu_loras: int | None = None,
                 lora_dtype: Any = None, fully_sharded_loras: bool = False, **extra: Any) -> None:
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.lora_dtype = lora_dtype
        self.fully_sharded_loras = fully_sharded_loras
        self.__dict__.update(extra)


MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]


@dataclasses.dataclass
class LoRAMapping:
    index_mapping: tuple
    prompt_mapping: tuple
    is_prefill: bool = False


@dataclasses.dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class LoRALayerWeights:
    def __init__(self, module_name: str, rank: int, lora_alpha: int, lora_a: torch.Tensor,
                 lora_b: torch.Tensor, scaling: float | None = None) -> None:
        self.module_name = module_name
        self.rank = rank
        self.lora_alpha = lora_alpha
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.scaling = lora_alpha / rank if scaling is None else scaling
        self.optimized = False

    def optimize(self) -> "LoRALayerWeights":
        if not self.optimized and self.scaling != 1:
            self.lora_b = self.lora_b * self.scaling
            self.scaling = 1
        self.optimized = True
        return self


class PackedLoRALayerWeights(LoRALayerWeights):
    pass


class LoRAModel:
    def __init__(self, lora_model_id: int, rank: int, loras: dict[str, LoRALayerWeights]) -> None:
        self.id = lora_model_id
        self.rank = rank
        self.loras = loras

    def get_lora(self, module_name: str) -> LoRALayerWeights | None:
        return self.loras.get(module_name)


@dataclasses.dataclass
class PEFTHelper:
    r: int
    lora_alpha: int
    target_modules: Any = None


class BaseLayerWithLoRA(nn.Module):
    punica_wrapper: Any = None

    def set_mapping(self, punica_wrapper) -> None:
        self.punica_wrapper = punica_wrapper

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return False


class BaseLinearLayerWithLoRA(BaseLayerWithLoRA):
    """Dense LoRA layers are never selected here: ``can_replace_layer`` is always False."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer


def _linear_layer_stub(name: str) -> type:
    return type(name, (BaseLinearLayerWithLoRA,), {"__module__": "vllm.lora.layers"})


ColumnParallelLinearWithLoRA = _linear_layer_stub("ColumnParallelLinearWithLoRA")
MergedColumnParallelLinearWithLoRA = _linear_layer_stub("MergedColumnParallelLinearWithLoRA")
QKVParallelLinearWithLoRA = _linear_layer_stub("QKVParallelLinearWithLoRA")
MergedQKVParallelLinearWithLoRA = _linear_layer_stub("MergedQKVParallelLinearWithLoRA")
ReplicatedLinearWithLoRA = _linear_layer_stub("ReplicatedLinearWithLoRA")
RowParallelLinearWithLoRA = _linear_layer_stub("RowParallelLinearWithLoRA")


class LinearBase(nn.Module):
    pass


class MergedColumnParallelLinear(LinearBase):
    pass


class QKVParallelLinear(LinearBase):
    pass


class MoERunner(nn.Module):
    """Stand-in for ``vllm.model_executor.layers.fused_moe.MoERunner`` (the isinstance target)."""


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


class StandInPunicaWrapper:
    """Keeps the host-side facts the MoE paths read: ``no_lora`` and the token→slot indices."""

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device, **kwargs) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = device
        self.lora_config = kwargs.get("lora_config")
        self.no_lora = False  # vLLM's PunicaWrapperBase default; only prefill metadata recomputes it
        self.is_prefill = False
        self._token_lora_indices = torch.full((max_num_batched_tokens,), -1, dtype=torch.long)
        self.update_calls = 0

    def update_metadata(self, mapping: LoRAMapping, lora_index_to_id, max_loras, vocab_size, **kwargs) -> None:
        self.update_calls += 1
        slots = [lora_index_to_id.index(i) if i > 0 and i in lora_index_to_id else -1
                 for i in mapping.index_mapping]
        self._token_lora_indices[: len(slots)] = torch.tensor(slots, dtype=torch.long)
        self.is_prefill = bool(mapping.is_prefill)
        if self.is_prefill:
            self.no_lora = all(s == -1 for s in slots)

    @property
    def token_lora_indices(self) -> torch.Tensor:
        return self._token_lora_indices


def get_punica_wrapper(max_num_batched_tokens: int, max_batches: int, device, **kwargs) -> StandInPunicaWrapper:
    return StandInPunicaWrapper(max_num_batched_tokens, max_batches, device, **kwargs)


class _GpuFusedExperts:
    """Plays ``FusedMoEWithLoRA._moe_kernel.fused_experts`` on the GPU path (context is required there)."""

    def __init__(self) -> None:
        self.lora_context = None
        self.calls: list[Any] = []

    def set_lora_context(self, ctx) -> None:
        self.calls.append(ctx)
        self.lora_context = ctx


class FusedMoEWithLoRA(BaseLayerWithLoRA):
    """Stand-in for ``vllm.lora.layers.fused_moe.FusedMoEWithLoRA`` with the attributes the manager uses."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.tp_size = getattr(base_layer, "tp_size", 1)
        self.tp_rank = getattr(base_layer, "tp_rank", 0)
        self.moe_config = base_layer.moe_config
        self._w13_slices = 2 if getattr(base_layer.moe_config, "is_act_and_mul", True) else 1
        self.enable_moe_shared_loras = False
        self.device = torch.device("cpu")
        # GPU wrappers route the context into their modular kernel; Ascend ones into the runner.
        self.gpu_experts = None if callable(getattr(base_layer, "set_lora_context", None)) else _GpuFusedExperts()
        self.create_calls = 0
        self.set_lora_calls = 0
        self.reset_lora_calls = 0

    # attributes read by DiffusionLoRAManager._bind_moe_adapter_weights / _bind_adapter_weights
    local_num_experts = property(lambda self: self.base_layer.local_num_experts)
    global_num_experts = property(lambda self: self.base_layer.global_num_experts)
    use_ep = property(lambda self: self.base_layer.use_ep)
    ep_rank = property(lambda self: self.base_layer.ep_rank)
    hidden_size = property(lambda self: self.base_layer.hidden_size)
    intermediate_size_per_partition = property(lambda self: self.base_layer.intermediate_size_per_partition)

    def create_lora_weights(self, max_loras: int, lora_config: LoRAConfig, model_config=None) -> None:
        self.create_calls += 1
        self.max_loras = lora_config.max_loras
        self.max_lora_rank = lora_config.max_lora_rank
        e, h, i, r = self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition, lora_config.max_lora_rank
        self.adapter_enabled = torch.zeros(max_loras + 1, dtype=torch.int)
        self.w13_lora_a_stacked = tuple(torch.zeros(max_loras, e, r, h) for _ in range(self._w13_slices))
        self.w13_lora_b_stacked = tuple(torch.zeros(max_loras, e, i, r) for _ in range(self._w13_slices))
        self.w2_lora_a_stacked = (torch.zeros(max_loras, e, r, i),)
        self.w2_lora_b_stacked = (torch.zeros(max_loras, e, h, r),)

    def reset_lora(self, index: int) -> None:
        self.reset_lora_calls += 1
        for t in (*self.w13_lora_a_stacked, *self.w13_lora_b_stacked, *self.w2_lora_a_stacked, *self.w2_lora_b_stacked):
            t[index] = 0
        self.adapter_enabled[index] = 0

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        assert isinstance(lora_a, list) and isinstance(lora_b, list) and len(lora_a) == len(lora_b) == 3
        self.set_lora_calls += 1
        self.reset_lora(index)
        self.adapter_enabled[index] = 1
        w1a, w2a, w3a = lora_a
        w1b, w2b, w3b = lora_b
        r = w1a.shape[1]
        self.w13_lora_a_stacked[0][index, :, :r].copy_(w1a)
        self.w13_lora_b_stacked[0][index, :, :, :r].copy_(w1b)
        if self._w13_slices == 2:
            self.w13_lora_a_stacked[1][index, :, :r].copy_(w3a)
            self.w13_lora_b_stacked[1][index, :, :, :r].copy_(w3b)
        self.w2_lora_a_stacked[0][index, :, :r].copy_(w2a)
        self.w2_lora_b_stacked[0][index, :, :, :r].copy_(w2b)

    def _build_lora_context(self) -> MoELoRAContext:
        return MoELoRAContext(
            w13_lora_a_stacked=self.w13_lora_a_stacked, w13_lora_b_stacked=self.w13_lora_b_stacked,
            w2_lora_a_stacked=self.w2_lora_a_stacked, w2_lora_b_stacked=self.w2_lora_b_stacked,
            adapter_enabled=self.adapter_enabled, max_loras=self.max_loras,
            top_k=getattr(self.base_layer, "top_k", 1), local_num_experts=self.local_num_experts,
            punica_wrapper=self.punica_wrapper, owner=self,
        )

    def set_mapping(self, punica_wrapper) -> None:
        BaseLayerWithLoRA.set_mapping(self, punica_wrapper)
        ctx = self._build_lora_context()
        if self.gpu_experts is None:
            self.base_layer.set_lora_context(ctx)  # AscendFusedMoEWithLoRA.set_mapping
        else:
            self.gpu_experts.set_lora_context(ctx)  # vLLM FusedMoEWithLoRA.set_mapping

    def forward(self, *args, **kwargs):
        return self.base_layer(*args, **kwargs)


class FusedMoE3DWithLoRA(FusedMoEWithLoRA):
    pass


def get_adapter_absolute_path(path: str) -> str:
    return path


def get_supported_lora_modules(model: nn.Module) -> list[str]:
    return sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, LinearBase)})


def replace_submodule(model: nn.Module, module_name: str, new_module: nn.Module) -> nn.Module:
    parent_name, _, leaf = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new_module)
    return new_module


class _Platform:
    def __init__(self, device_type: str) -> None:
        self.device_type = device_type


# --------------------------------------------------------------------------------------
# fake MoE runners
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class FakeMoEConfig:
    num_experts: int = 2
    is_act_and_mul: bool = True


class _FakeMoERunnerBase(MoERunner):
    def __init__(self, num_experts: int = 2, hidden_size: int = 8, intermediate_size: int = 16, top_k: int = 1) -> None:
        super().__init__()
        self.moe_config = FakeMoEConfig(num_experts=num_experts)
        self.global_num_experts = num_experts
        self.local_num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = intermediate_size
        self.top_k = top_k
        self.tp_size, self.tp_rank, self.use_ep, self.ep_rank = 1, 0, False, 0
        self.forward_calls = 0
        # The real runner has pre-hooks (token counts, NPU comm context); omni asserts they survive.
        self.register_forward_pre_hook(lambda module, args: None)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        self.forward_calls += 1
        return hidden_states


class AscendLikeMoERunner(_FakeMoERunnerBase):
    """Has ``set_lora_context`` like vllm-ascend's runner; counts forwards that ran the LoRA path."""

    _ascend_moe_lora_context = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lora_context_calls: list[Any] = []
        self.forwards_with_context = 0

    def set_lora_context(self, lora_context) -> None:
        self.lora_context_calls.append(lora_context)
        self._ascend_moe_lora_context = lora_context

    @property
    def lora_context(self):
        return self._ascend_moe_lora_context

    def forward(self, hidden_states, router_logits=None):
        if self._ascend_moe_lora_context is not None:
            self.forwards_with_context += 1  # on NPU: argsort routing recovery + two LoRA kernels
        return super().forward(hidden_states, router_logits)


class GpuLikeMoERunner(_FakeMoERunnerBase):
    """No ``set_lora_context``: the GPU wrapper's kernel needs its context at all times."""


class FakeTransformer(nn.Module):
    def __init__(self, **runner_kwargs) -> None:
        super().__init__()
        self.moe_ascend = AscendLikeMoERunner(**runner_kwargs)
        self.moe_gpu = GpuLikeMoERunner(**runner_kwargs)

    def forward(self, x):
        return self.moe_gpu(self.moe_ascend(x))


class FakePipeline(nn.Module):
    """Pipeline with one MoE runner of each kind and the manager's optional hooks.

    ``adapter_ranks`` maps a LoRA path to its rank; adapters cover every expert projection of
    both runners. ``fail_next`` makes the next activation fail: ``"merge"`` raises from
    ``_create_diffusion_merged_lora`` (after the MoE context was published), ``"validate"``
    raises from ``_validate_diffusion_lora_binding`` (before publishing).
    """

    od_config = None

    def __init__(self, adapter_ranks: dict[str, int] | None = None, **runner_kwargs) -> None:
        super().__init__()
        self.transformer = FakeTransformer(**runner_kwargs)
        self.adapter_ranks = dict(adapter_ranks or {})
        self.fail_next: str | None = None

    @property
    def ascend_runner(self) -> AscendLikeMoERunner:
        return self._find(AscendLikeMoERunner)

    @property
    def gpu_runner(self) -> GpuLikeMoERunner:
        return self._find(GpuLikeMoERunner)

    def _find(self, cls):
        for m in self.modules():
            if type(m) is cls:
                return m
        raise LookupError(cls.__name__)

    def _load_diffusion_lora_adapter(self, *, lora_request, lora_path, dtype):
        rank = self.adapter_ranks[lora_path]
        gen = torch.Generator().manual_seed(lora_request.lora_int_id)
        loras: dict[str, LoRALayerWeights] = {}
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
        return None


# --------------------------------------------------------------------------------------
# sandbox
# --------------------------------------------------------------------------------------
def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _package(name: str, path: list[str] | None = None, **attrs: Any) -> types.ModuleType:
    mod = _module(name, **attrs)
    mod.__path__ = list(path or [])
    mod.__package__ = name
    return mod


def _vllm_stub_modules(device_type: str) -> dict[str, types.ModuleType]:
    layers_attrs = dict(BaseLayerWithLoRA=BaseLayerWithLoRA, LoRAMapping=LoRAMapping,
                        FusedMoEWithLoRA=FusedMoEWithLoRA)
    mods = {
        "vllm": _package("vllm", __version__="0.32.0+omni-patches-stub"),
        "vllm.logger": _module("vllm.logger", init_logger=logging.getLogger),
        "vllm.config": _package("vllm.config"),
        "vllm.config.lora": _module("vllm.config.lora", LoRAConfig=LoRAConfig, MaxLoRARanks=MaxLoRARanks),
        "vllm.lora": _package("vllm.lora"),
        "vllm.lora.layers": _package("vllm.lora.layers", **layers_attrs),
        "vllm.lora.layers.base": _module("vllm.lora.layers.base", BaseLayerWithLoRA=BaseLayerWithLoRA),
        "vllm.lora.layers.base_linear": _module("vllm.lora.layers.base_linear",
                                                BaseLinearLayerWithLoRA=BaseLinearLayerWithLoRA),
        "vllm.lora.layers.column_parallel_linear": _module(
            "vllm.lora.layers.column_parallel_linear",
            ColumnParallelLinearWithLoRA=ColumnParallelLinearWithLoRA,
            MergedColumnParallelLinearWithLoRA=MergedColumnParallelLinearWithLoRA,
            QKVParallelLinearWithLoRA=QKVParallelLinearWithLoRA,
            MergedQKVParallelLinearWithLoRA=MergedQKVParallelLinearWithLoRA),
        "vllm.lora.layers.replicated_linear": _module("vllm.lora.layers.replicated_linear",
                                                      ReplicatedLinearWithLoRA=ReplicatedLinearWithLoRA),
        "vllm.lora.layers.row_parallel_linear": _module("vllm.lora.layers.row_parallel_linear",
                                                        RowParallelLinearWithLoRA=RowParallelLinearWithLoRA),
        "vllm.lora.layers.fused_moe": _module("vllm.lora.layers.fused_moe", FusedMoEWithLoRA=FusedMoEWithLoRA,
                                              FusedMoE3DWithLoRA=FusedMoE3DWithLoRA),
        "vllm.lora.lora_model": _module("vllm.lora.lora_model", LoRAModel=LoRAModel),
        "vllm.lora.lora_weights": _module("vllm.lora.lora_weights", LoRALayerWeights=LoRALayerWeights,
                                          PackedLoRALayerWeights=PackedLoRALayerWeights),
        "vllm.lora.peft_helper": _module("vllm.lora.peft_helper", PEFTHelper=PEFTHelper),
        "vllm.lora.request": _module("vllm.lora.request", LoRARequest=LoRARequest),
        "vllm.lora.utils": _module("vllm.lora.utils", get_adapter_absolute_path=get_adapter_absolute_path,
                                   get_supported_lora_modules=get_supported_lora_modules,
                                   replace_submodule=replace_submodule),
        "vllm.lora.punica_wrapper": _package("vllm.lora.punica_wrapper", get_punica_wrapper=get_punica_wrapper),
        "vllm.model_executor": _package("vllm.model_executor"),
        "vllm.model_executor.layers": _package("vllm.model_executor.layers"),
        "vllm.model_executor.layers.linear": _module("vllm.model_executor.layers.linear", LinearBase=LinearBase,
                                                     MergedColumnParallelLinear=MergedColumnParallelLinear,
                                                     QKVParallelLinear=QKVParallelLinear),
        "vllm.model_executor.layers.fused_moe": _package("vllm.model_executor.layers.fused_moe",
                                                         MoERunner=MoERunner, FusedMoE=MoERunner),
        "vllm.platforms": _package("vllm.platforms", current_platform=_Platform(device_type)),
    }
    if importlib.util.find_spec("transformers") is None:
        mods["transformers"] = _package("transformers", PretrainedConfig=type("PretrainedConfig", (), {}))
    return mods


@dataclasses.dataclass
class OmniSandbox:
    root: Path
    manager_module: types.ModuleType
    utils_module: types.ModuleType
    modules: dict[str, types.ModuleType]

    @property
    def DiffusionLoRAManager(self) -> type:
        return self.manager_module.DiffusionLoRAManager

    # re-exported for drivers/tests
    LoRARequest = LoRARequest
    FakePipeline = FakePipeline
    FusedMoEWithLoRA = FusedMoEWithLoRA


def _snapshot(roots: tuple[str, ...]) -> dict[str, types.ModuleType]:
    return {k: v for k, v in sys.modules.items() if k.split(".")[0] in roots}


@contextlib.contextmanager
def omni_sandbox(version: str = OMNI_VERSION, *, device_type: str = "cuda"):
    """Install stubs + the real omni LoRA files into ``sys.modules``; restore them on exit.

    ``device_type`` feeds ``vllm.platforms.current_platform.device_type``; keep it non-"npu"
    (the "npu" branch of ``_select_moe_lora_wrapper_cls`` imports ``vllm_ascend``).
    """
    root = wheels.fetch_or_skip("vllm-omni", version)
    saved = _snapshot(_STUB_ROOTS)
    for name in saved:
        del sys.modules[name]
    try:
        mods = _vllm_stub_modules(device_type)
        for name, rel in _REAL_PACKAGE_DIRS.items():
            mods[name] = _package(name, [str(root / rel)])
        sys.modules.update(mods)
        importlib.invalidate_caches()
        manager = importlib.import_module("vllm_omni.diffusion.lora.manager")
        utils = importlib.import_module("vllm_omni.diffusion.lora.utils")
        if not str(manager.__file__).startswith(str(root)):
            raise RuntimeError(f"sandbox loaded {manager.__file__}, not the wheel under {root}")
        yield OmniSandbox(root=root, manager_module=manager, utils_module=utils, modules=_snapshot(_STUB_ROOTS))
    finally:
        for name in list(_snapshot(_STUB_ROOTS)):
            del sys.modules[name]
        sys.modules.update(saved)


# --------------------------------------------------------------------------------------
# lifecycle driver
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepReport:
    step: str
    active: int | None
    suspended: int | None
    adapter_active: bool
    ascend_has_context: bool
    ascend_set_calls: int
    ascend_context_enabled: bool | None  # adapter_enabled[0] of the attached context
    gpu_has_context: bool | None  # None once the GPU runner is unwrapped
    runners_wrapped: bool
    error: str | None = None

    @property
    def invariant_ok(self) -> bool:
        """The patch's post-condition: Ascend-like runner has a context iff an adapter is active."""
        return self.ascend_has_context == self.adapter_active

    def line(self) -> str:
        flag = "ok " if self.invariant_ok else "BAD"
        return (f"[{flag}] {self.step:<34} active={self.active} suspended={self.suspended} "
                f"ascend_ctx={self.ascend_has_context} (enabled={self.ascend_context_enabled}, "
                f"set_calls={self.ascend_set_calls}) gpu_ctx={self.gpu_has_context} "
                f"wrapped={self.runners_wrapped}" + (f" error={self.error}" if self.error else ""))


def snapshot(step: str, manager, pipeline: FakePipeline, error: str | None = None) -> StepReport:
    ascend = pipeline.ascend_runner
    ctx = ascend.lora_context
    gpu_wrapper = next((m for m in manager._lora_modules.values()
                        if isinstance(m, FusedMoEWithLoRA) and m.gpu_experts is not None), None)
    return StepReport(
        step=step,
        active=manager._active_adapter_id,
        suspended=manager._suspended_adapter_id,
        adapter_active=manager._active_adapter_id is not None,
        ascend_has_context=ctx is not None,
        ascend_set_calls=len(ascend.lora_context_calls),
        ascend_context_enabled=None if ctx is None else bool(int(ctx.adapter_enabled[0])),
        gpu_has_context=None if gpu_wrapper is None else gpu_wrapper.gpu_experts.lora_context is not None,
        runners_wrapped=any(isinstance(m, FusedMoEWithLoRA) for m in pipeline.modules()),
        error=error,
    )


def run_lifecycle(sb: OmniSandbox, *, fail_at: str = "merge", manager_factory=None) -> list[StepReport]:
    """Walk activate → deactivate → idle rank growth → re-arm → failed activation → remove → close.

    Adapter A (id 1) has rank 8, adapter B (id 2) rank 16, so adding B while idle grows the
    max rank. ``manager_factory(pipeline)`` may build the manager (default: the real class with
    ``max_cached_adapters=2, max_num_batched_tokens=64``).
    """
    req_a = LoRARequest("a", 1, "/adapters/a")
    req_b = LoRARequest("b", 2, "/adapters/b")
    pipe = FakePipeline({req_a.lora_path: 8, req_b.lora_path: 16})
    if manager_factory is None:
        mgr = sb.DiffusionLoRAManager(pipe, torch.device("cpu"), torch.float32,
                                      max_cached_adapters=2, max_num_batched_tokens=64)
    else:
        mgr = manager_factory(pipe)
    out: list[StepReport] = []
    x = torch.zeros(4, 8)

    def step(name: str, fn, *, forward: bool = True) -> None:
        err = None
        try:
            fn()
        except Exception as exc:  # the failed-activation step raises by design
            err = f"{type(exc).__name__}: {exc}"
        if forward and not mgr._closed:
            pipe.transformer(x)
        out.append(snapshot(name, mgr, pipe, err))

    step("init (lazy wrapping)", lambda: None)
    step("activate A (r8)", lambda: mgr.set_active_adapter(req_a, 1.0))
    step("deactivate (set_active_adapter None)", lambda: mgr.set_active_adapter(None))
    step("idle add B (r16): max-rank growth", lambda: mgr.add_adapter(req_b))
    step("activate A again (full bind)", lambda: mgr.set_active_adapter(req_a, 1.0))
    step("deactivate", lambda: mgr.set_active_adapter(None))
    step("re-arm suspended A", lambda: mgr.set_active_adapter(req_a, 1.0))

    def failing_activation():
        pipe.fail_next = fail_at
        mgr.set_active_adapter(req_b, 1.0)

    step(f"activate B fails ({fail_at}) -> rollback", failing_activation)
    step("activate A (full bind)", lambda: mgr.set_active_adapter(req_a, 1.0))
    step("remove active A", lambda: mgr.remove_adapter(1))
    step("activate B", lambda: mgr.set_active_adapter(req_b, 1.0))
    step("close", mgr.close, forward=False)
    return out


def main() -> int:  # python -m patches.moe_lora_idle_detach.omni_manager
    with omni_sandbox() as sb:
        for fail_at in ("merge", "validate"):
            print(f"-- stock DiffusionLoRAManager {OMNI_VERSION} (failure injected at {fail_at!r})")
            for rep in run_lifecycle(sb, fail_at=fail_at):
                print(rep.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
