"""Import REAL vllm-ascend 0.23.0(.post1) MoE files on a CPU machine without torch_npu / CANN / vLLM 0.23.

(Kept for helpers that import it. Every release with the real vLLM it was built for: ``tests.support.ascend_real``.)

Only the PyPI sdist of vllm-ascend exists (building it fails here), so ``tests.support.wheels``
downloads it with ``pip download --no-deps --no-binary :all: --no-build-isolation`` and the
environment below (needs ``setuptools_scm`` installed in the running interpreter).

Real files loaded from the sdist (everything else is a stand-in written here):

* ``vllm_ascend/ops/fused_moe/fused_moe.py`` — ``AscendUnquantizedFusedMoEMethod.apply`` (reads
  ``getattr(layer, "_ascend_moe_lora_context", None)``); with ``vllm_version="0.23.0"`` it
  re-exports ``AscendFusedMoE``/``AscendMoERunner`` from ``fused_moe_0_23_0.py``, with any other
  version it defines the newer in-file ``AscendMoERunner`` (``no_shared_forward_impl``,
  context on ``self.routed_experts``).
* ``fused_moe_0_23_0.py``, ``moe_mlp.py`` (``unquant_apply_mlp(..., lora_context=...)``),
  ``moe_runtime_args.py``, ``moe_stage_contracts.py``, ``moe_stage_params.py``,
  ``quantization/quant_type.py`` and ``lora/fused_moe.py`` (``moe_lora_apply_w13/_w2``,
  ``AscendFusedMoEWithLoRA``).

Stand-ins: ``torch_npu``, every other ``vllm_ascend.*`` module and (unless ``real_vllm=True``)
every ``vllm.*`` module are auto-generated: a CamelCase attribute becomes a permissive class,
anything else a ``MagicMock``; a few names get explicit values (``vllm_version_is``,
``_EXTRA_CTX``, ``MoECommType``, ``MoEActivation``, nn.Module bases for ``FusedMoE``/``MoERunner``/
``BaseLayerWithLoRA``/``FusedMoEWithLoRA``, ``HAS_TRITON=False``, ``VLLM_ASCEND_ENABLE_FUSED_MC2=0``).
This mirrors what vllm-ascend's own ``tests/ut/conftest.py`` does (torch_npu replaced by a module
of MagicMocks, ``torch.npu`` a MagicMock), minus the real vLLM.

Usage::

    with ascend_sandbox() as sb:               # 0.23.0.post1, vLLM-0.23 layout
        sb.fused_moe_0_23_0.AscendFusedMoE      # real class
        sb.moe_mlp.unquant_apply_mlp            # real function; its torch_npu is sb.torch_npu
    # sys.modules, sys.meta_path and torch.npu are restored on exit
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import torch
import torch.nn as nn

from tests.support import wheels
from tests.support.automods import AutoModule

ASCEND_VERSION = "0.23.0.post1"
SDIST_ENV = {"SOC_VERSION": "ascend910b1", "COMPILE_CUSTOM_KERNELS": "0"}

REAL_FILES = {
    "vllm_ascend.ops.fused_moe.fused_moe": "vllm_ascend/ops/fused_moe/fused_moe.py",
    "vllm_ascend.ops.fused_moe.fused_moe_0_23_0": "vllm_ascend/ops/fused_moe/fused_moe_0_23_0.py",
    "vllm_ascend.ops.fused_moe.moe_mlp": "vllm_ascend/ops/fused_moe/moe_mlp.py",
    "vllm_ascend.ops.fused_moe.moe_runtime_args": "vllm_ascend/ops/fused_moe/moe_runtime_args.py",
    "vllm_ascend.ops.fused_moe.moe_stage_contracts": "vllm_ascend/ops/fused_moe/moe_stage_contracts.py",
    "vllm_ascend.ops.fused_moe.moe_stage_params": "vllm_ascend/ops/fused_moe/moe_stage_params.py",
    "vllm_ascend.quantization.quant_type": "vllm_ascend/quantization/quant_type.py",
    "vllm_ascend.lora.fused_moe": "vllm_ascend/lora/fused_moe.py",
}
# Packages whose real __init__ would drag in the world: replaced by empty packages.
EMPTY_PACKAGES = ("vllm_ascend", "vllm_ascend.ops", "vllm_ascend.ops.fused_moe",
                  "vllm_ascend.quantization", "vllm_ascend.lora")
_ROOTS = ("vllm", "vllm_ascend", "torch_npu", "triton")


def sdist_root(version: str = ASCEND_VERSION) -> Path:
    """Unpacked sdist top directory of ``vllm-ascend==version`` (skips the test when offline, unless CI)."""
    return wheels.fetch_or_skip("vllm-ascend", version, sdist=True, extra_env=SDIST_ENV)


# --------------------------------------------------------------------------------------
# stand-ins (our own code)
# --------------------------------------------------------------------------------------
class MoECommType(enum.Enum):
    ALLGATHER = 0
    MC2 = 1
    ALLTOALL = 2
    FUSED_MC2 = 3


class MoEActivation(str, enum.Enum):
    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    SWIGLUOAI = "swigluoai"
    SWIGLUSTEP = "swiglustep"


class FusedMoE(nn.Module):
    """nn.Module base for ``AscendFusedMoE`` (construct real subclasses with ``bare_instance``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


class MoERunner(nn.Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()


class UnquantizedFusedMoEMethod:
    def __init__(self, moe: Any = None, *args: Any, **kwargs: Any) -> None:
        self.moe = moe

    def process_weights_after_loading(self, layer) -> None:
        pass


class BaseLayerWithLoRA(nn.Module):
    punica_wrapper: Any = None

    def set_mapping(self, punica_wrapper) -> None:
        self.punica_wrapper = punica_wrapper


class FusedMoEWithLoRA(BaseLayerWithLoRA):
    pass


class FusedMoE3DWithLoRA(FusedMoEWithLoRA):
    pass


@contextlib.contextmanager
def _no_stream_switch(*args: Any, **kwargs: Any):
    yield


class _OnceLogger(logging.LoggerAdapter):
    def warning_once(self, msg, *args, **kwargs):
        self.warning(msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self.info(msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args, **kwargs)


def _overrides(vllm_version: str) -> dict[str, dict[str, Any]]:
    extra_ctx = types.SimpleNamespace(
        moe_comm_type=MoECommType.ALLGATHER, moe_comm_method=MagicMock(name="_EXTRA_CTX.moe_comm_method"),
        flash_comm_v1_enabled=False, in_profile_run=False, eplb_heat_collection_status=False)
    logger = _OnceLogger(logging.getLogger("vllm_ascend.stub"), {})
    return {
        "vllm": {"__version__": vllm_version},
        "vllm.logger": {"logger": logger, "init_logger": lambda name: _OnceLogger(logging.getLogger(name), {})},
        "vllm.triton_utils": {"HAS_TRITON": False},
        "vllm.model_executor.layers.fused_moe.layer": {
            "FusedMoE": FusedMoE, "MoERunner": MoERunner, "UnquantizedFusedMoEMethod": UnquantizedFusedMoEMethod},
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method": {
            "UnquantizedFusedMoEMethod": UnquantizedFusedMoEMethod},
        "vllm.model_executor.layers.fused_moe.activation": {"MoEActivation": MoEActivation},
        "vllm.lora.layers.base": {"BaseLayerWithLoRA": BaseLayerWithLoRA},
        "vllm.lora.layers.fused_moe": {"FusedMoEWithLoRA": FusedMoEWithLoRA,
                                       "FusedMoE3DWithLoRA": FusedMoE3DWithLoRA},
        "vllm_ascend.utils": {
            "vllm_version_is": lambda v: v == vllm_version, "enable_sp": lambda *a, **k: False,
            "ACL_FORMAT_FRACTAL_NZ": 29, "maybe_trans_nz": lambda x, *a, **k: x,
            "npu_stream_switch": _no_stream_switch, "shared_expert_dp_enabled": lambda: False,
            "enable_custom_op": lambda: False, "dispose_tensor": lambda x: None},
        "vllm_ascend.ascend_forward_context": {"_EXTRA_CTX": extra_ctx, "MoECommType": MoECommType},
        "vllm_ascend.envs": {"VLLM_ASCEND_ENABLE_FUSED_MC2": 0},
    }


class _StubLoader(importlib.abc.Loader):
    def __init__(self, overrides: dict[str, dict[str, Any]], auto: bool) -> None:
        self.overrides = overrides
        self.auto = auto

    def create_module(self, spec):
        mod = (AutoModule if self.auto else types.ModuleType)(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module) -> None:
        module.__dict__.update(self.overrides.get(module.__name__, {}))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path, stub_roots: tuple[str, ...], overrides) -> None:
        self.root = root
        self.stub_roots = stub_roots
        self.auto_loader = _StubLoader(overrides, auto=True)
        self.pkg_loader = _StubLoader(overrides, auto=False)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in REAL_FILES:
            return importlib.util.spec_from_file_location(fullname, self.root / REAL_FILES[fullname])
        if fullname in EMPTY_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self.pkg_loader, is_package=True)
        if fullname.split(".")[0] in self.stub_roots:
            return importlib.machinery.ModuleSpec(fullname, self.auto_loader, is_package=True)
        return None


@dataclasses.dataclass
class AscendSandbox:
    root: Path
    version: str
    vllm_version: str
    fused_moe: types.ModuleType
    fused_moe_0_23_0: types.ModuleType | None
    moe_mlp: types.ModuleType
    torch_npu: types.ModuleType
    extra_ctx: Any

    @property
    def AscendFusedMoE(self) -> type | None:
        """The 0.23.0 layer class (``forward_impl``, context on self); None in the newer layout."""
        return None if self.fused_moe_0_23_0 is None else self.fused_moe_0_23_0.AscendFusedMoE

    @property
    def AscendMoERunner(self) -> type:
        return self.fused_moe.AscendMoERunner

    @staticmethod
    def import_real(name: str) -> types.ModuleType:
        return importlib.import_module(name)

    @staticmethod
    def bare_instance(cls: type, **attrs: Any):
        """An instance of a real nn.Module subclass without running its (huge) ``__init__``."""
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)
        for k, v in attrs.items():
            setattr(obj, k, v)
        return obj


@contextlib.contextmanager
def ascend_sandbox(version: str = ASCEND_VERSION, *, vllm_version: str = "0.23.0", real_vllm: bool = False):
    """Make the real vllm-ascend MoE files importable; undo every global change on exit.

    ``real_vllm=True`` leaves ``vllm`` to the installed distribution (vllm-ascend 0.23 expects
    vLLM 0.23, which is not installable here; newer vLLMs may lack names it imports).
    """
    root = sdist_root(version)
    roots = tuple(r for r in _ROOTS if not (real_vllm and r == "vllm"))
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in _ROOTS}
    for name in saved:
        if name.split(".")[0] in roots:
            del sys.modules[name]
    had_npu, old_npu = hasattr(torch, "npu"), getattr(torch, "npu", None)
    finder = _Finder(root, roots, _overrides(vllm_version))
    sys.meta_path.insert(0, finder)
    try:
        if not had_npu:
            npu = MagicMock(name="torch.npu")
            npu.Stream = MagicMock
            npu.Event = MagicMock
            torch.npu = npu
        torch_npu = importlib.import_module("torch_npu")
        fused_moe = importlib.import_module("vllm_ascend.ops.fused_moe.fused_moe")
        fm0230 = (importlib.import_module("vllm_ascend.ops.fused_moe.fused_moe_0_23_0")
                  if vllm_version == "0.23.0" else None)
        moe_mlp = importlib.import_module("vllm_ascend.ops.fused_moe.moe_mlp")
        ctx = importlib.import_module("vllm_ascend.ascend_forward_context")._EXTRA_CTX
        yield AscendSandbox(root=root, version=version, vllm_version=vllm_version, fused_moe=fused_moe,
                            fused_moe_0_23_0=fm0230, moe_mlp=moe_mlp, torch_npu=torch_npu, extra_ctx=ctx)
    finally:
        sys.meta_path.remove(finder)
        for name in [k for k in sys.modules if k.split(".")[0] in _ROOTS]:
            del sys.modules[name]
        sys.modules.update(saved)
        if had_npu:
            torch.npu = old_npu
        elif hasattr(torch, "npu"):
            del torch.npu


def cpu_grouped_matmul(*, x, weight, group_list, group_list_type=1, **_: Any):
    """CPU stand-in for ``torch_npu.npu_grouped_matmul`` (split_item=2, group_type=0).

    ``group_list_type=1`` means per-expert token counts, 0 means cumulative ends.
    """
    (inp,), (w,) = x, weight
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        outs.append(inp[start:start + n] @ w[e])
        start += n
    return [torch.cat(outs) if outs else inp.new_zeros(0, w.shape[-1])]


def cpu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    gate, up = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(gate) * up


def main() -> int:  # python -m tests.support.ascend_stubs
    import inspect

    for version in ("0.23.0.post1", "0.23.0"):
        with ascend_sandbox(version) as sb:
            cls = sb.AscendFusedMoE
            print(version, "AscendFusedMoE.forward_impl", inspect.signature(cls.forward_impl))
            print(version, "AscendFusedMoE.set_lora_context", inspect.signature(cls.set_lora_context))
            print(version, "unquant_apply_mlp", inspect.signature(sb.moe_mlp.unquant_apply_mlp))
        with ascend_sandbox(version, vllm_version="0.24.0") as sb:
            runner = sb.AscendMoERunner
            print(version, "[newer layout] AscendMoERunner.no_shared_forward_impl",
                  inspect.signature(runner.no_shared_forward_impl))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
