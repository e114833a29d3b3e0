"""TEST SUPPORT ONLY: a CPU platform for vllm-omni, so the serving tier can run a real ``vllm serve --omni`` here.

vllm-omni 0.28.0-0.32.0rc1 ship no CPU platform (``vllm_omni/platforms/``: cuda, rocm, npu, xpu, musa; without
one, ``get_default_stage_config_path`` raises ``NotImplementedError``), and its diffusion attention backends
dispatch per platform with no CPU branch (``diffusion/attention/backends/abstract.py``). This module supplies both:

* ``CpuOmniPlatform`` derives from vllm-omni's ``OmniPlatform`` and vLLM's ``CpuPlatform`` (so vLLM's own CPU
  answers -- gloo, the CPU punica wrapper, ``device_type = "cpu"`` -- stay vLLM's), declares itself out-of-tree,
  answers device and memory questions from psutil, and makes peak-memory / cache calls no-ops;
* its diffusion attention backend is ``serving_cpu_attention.CpuSDPABackend``: vllm-omni's own ``SDPABackend``
  whose ``forward`` runs the backend's torch SDPA path on CPU.

In every server, bf16 / fp16 convolutions compute in fp32 and round back (``_half_convolutions_in_fp32``: a CPU
without native bf16 runs them 32-124x slower -- ``bench/conv_dtype.py`` -- which made the tiers' servers CPU-bound
on their VAEs).

One test-support switch, for the serving tier's start-up deadline case: with ``OMNI_SERVING_TEST_STAGE_INIT_HANG=1``
in a server's environment, a diffusion stage process (the spawned ``StageDiffusionProc``) blocks for good while
it starts, at its import of this platform -- before its handshake's READY, as a stage stuck in a model download or
device init would. The API server and every other process are unaffected; no server of the tier sets it otherwise.

For the MoE serving tier (a tiny HunyuanImage3 on vllm-omni 0.22.0, tests/test_serving_moe.py) it also answers
``get_current_memory_usage`` (this process's RSS), answers ``get_device_count`` from
``OMNI_SERVING_TEST_DEVICE_COUNT`` (default 1: a multi-rank server sets its world size), runs ``GroupNorm`` in fp32
when its input's dtype differs from its parameters' (the VAE decodes under fp16 autocast), and, with
``OMNI_SERVING_TEST_MOE_STANDINS=1`` only, installs the CPU MoE stand-ins (``moe_standins``, a copy of
``support/cpu_moe_standins.py``) in every process of the server. The Wan servers set neither switch.

``support.serving`` copies this file as ``omni_patches_test_cpu_platform/platform.py`` (and the backend as
``attention.py``) into a directory on the test
server's ``PYTHONPATH`` (the stack venvs are not changed), next to a dist-info that registers the package's
``plugin`` under vllm-omni's entry-point group ``vllm_omni.platform_plugins``. It is no part of omni-patches and is
never installed by it.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time

import torch
from vllm.platforms.cpu import CpuPlatform

from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

# The attention backend is a sibling module (``serving_cpu_attention.py``, copied as ``attention.py``): it imports
# vllm-omni's attention package, which needs the resolved platform, so it cannot be imported from here.
ATTENTION = __name__.rpartition(".")[0] + ".attention.CpuSDPABackend"


def _memory():
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _keep_linear_weights() -> None:
    """Make vLLM's unquantized linear layers keep their weights as parameters, as they do on an accelerator.

    On CPU, vLLM's ``UnquantizedLinearMethod.process_weights_after_loading`` packs each weight for oneDNN/SGL and
    replaces ``layer.weight`` with an empty parameter (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``,
    ``vllm/model_executor/layers/utils.py``). On CUDA/NPU the weight stays a ``ModelWeightParameter`` and vllm-omni's
    distill LoRA loader adds its deltas to it in place; here the same must hold, so every such layer computes with
    ``torch.nn.functional.linear`` on the weight it is called with.
    """
    import vllm.model_executor.layers.utils as utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "_omni_test_keeps_weights", False):
        return

    def dispatch_keeping_weights(layer, remove_weight):
        layer.cpu_linear = torch.nn.functional.linear

    dispatch_keeping_weights._omni_test_keeps_weights = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weights


_keep_linear_weights()

#: TEST SUPPORT env switch (see the module docstring): "1" makes a diffusion stage process hang while it starts.
STAGE_INIT_HANG = "OMNI_SERVING_TEST_STAGE_INIT_HANG"


def _hang_in_stage_start_up() -> None:
    """Block this process for good if it is a diffusion stage process and the test-support switch is on."""
    if os.environ.get(STAGE_INIT_HANG) != "1" or multiprocessing.current_process().name != "StageDiffusionProc":
        return
    print(f"[omni-patches test support] {STAGE_INIT_HANG}=1: diffusion stage process {os.getpid()} hangs in its "
          "start-up", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


_hang_in_stage_start_up()

#: TEST SUPPORT env switches of the MoE serving tier (tests/test_serving_moe.py): how many "devices" the platform
#: answers (a multi-rank server sets its world size; default 1), and "1" to install the CPU MoE stand-ins
#: (``moe_standins``, a copy of tests/support/cpu_moe_standins.py) in every process of the server.
DEVICE_COUNT = "OMNI_SERVING_TEST_DEVICE_COUNT"
MOE_STANDINS = "OMNI_SERVING_TEST_MOE_STANDINS"


def _group_norm_in_parameter_dtype() -> None:
    """TEST SUPPORT: ``torch.nn.GroupNorm`` runs in fp32 when its input's dtype is not its parameters'.

    HunyuanImage3's VAE decodes under fp16 autocast (``autocast`` does not cover ``group_norm`` on CPU), so a bf16
    GroupNorm meets fp16 activations and ``F.group_norm`` refuses the mix; an accelerator's autocast upcasts it.
    Same dtypes: the real forward, untouched."""
    GroupNorm = torch.nn.GroupNorm
    if getattr(GroupNorm.forward, "_omni_test_fp32_mixed", False):
        return
    real = GroupNorm.forward

    def forward(self, input):
        weight = self.weight
        if weight is None or input.dtype == weight.dtype:
            return real(self, input)
        bias = self.bias.float() if self.bias is not None else None
        out = torch.nn.functional.group_norm(input.float(), self.num_groups, weight.float(), bias, self.eps)
        return out.to(input.dtype)

    forward._omni_test_fp32_mixed = True
    GroupNorm.forward = forward


_group_norm_in_parameter_dtype()


def _half_convolutions_in_fp32() -> None:
    """TEST SUPPORT: a bf16 / fp16 convolution (``Conv1d/2d/3d``, the tiny models' VAEs) computes in fp32 and rounds
    its result to the half dtype, as an accelerator's kernels accumulate in fp32.

    On a CPU without native bf16 (AVX2 only: an AMD EPYC, torch 2.13, ``bench/conv_dtype.py``) a bf16 ``Conv2d`` of
    32 channels at 64x64 takes 71-124x the time of this form and ``Conv3d`` 32-67x: the served VAEs made the servers
    CPU-bound on their decode (a CPU with AMX does not notice). Stock and shim servers get the same switch, so
    the tiers' pixel comparisons are unchanged; under autocast the half dtype is autocast's. Anything else (fp32,
    mixed dtypes stock refuses, another device): the real forward, untouched."""
    half = (torch.bfloat16, torch.float16)
    for cls in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
        real = cls._conv_forward
        if getattr(real, "_omni_test_fp32_half", False):
            continue

        def _conv_forward(self, input, weight, bias, _real=real):
            if input.device.type != "cpu":
                return _real(self, input, weight, bias)
            if torch.is_autocast_enabled("cpu"):
                dtype = torch.get_autocast_dtype("cpu")
            elif input.dtype == weight.dtype and (bias is None or bias.dtype == input.dtype):
                dtype = input.dtype
            else:
                dtype = None
            if dtype not in half:
                return _real(self, input, weight, bias)
            with torch.autocast("cpu", enabled=False):
                out = _real(self, input.float(), weight.float(), None if bias is None else bias.float())
            return out.to(dtype)

        _conv_forward._omni_test_fp32_half = True
        cls._conv_forward = _conv_forward


_half_convolutions_in_fp32()


def _rss(cls=None, device=None) -> float:
    import psutil

    return float(psutil.Process().memory_info().rss)


def _cpu_memory_usage() -> None:
    """TEST SUPPORT: vLLM's ``CpuPlatform`` (vLLM's own ``current_platform`` in these processes) answers
    ``get_current_memory_usage`` with this process's RSS; its base raises ``NotImplementedError``, and vllm-omni's
    diffusion model runner measures its load with ``DeviceMemoryProfiler``, which asks vLLM's platform."""
    from vllm.platforms.interface import Platform

    if CpuPlatform.get_current_memory_usage.__func__ is Platform.get_current_memory_usage.__func__:
        CpuPlatform.get_current_memory_usage = classmethod(_rss)


_cpu_memory_usage()


def _moe_standins() -> None:
    """TEST SUPPORT: with ``OMNI_SERVING_TEST_MOE_STANDINS=1``, the CPU MoE stand-ins for this process's life
    (expert map honoured by CPU experts, gloo ``all_gatherv``/``reduce_scatterv``; one ``OMNI_TEST_MOE_LAYOUT``
    line per process that runs an EP MoE layer). Without it (every Wan server) nothing is installed."""
    if os.environ.get(MOE_STANDINS) != "1":
        return
    import importlib

    package = __name__.rpartition(".")[0]
    importlib.import_module(f"{package}.moe_standins" if package else "moe_standins").install_in_process()


_moe_standins()


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM's CPU platform plus the vllm-omni interface, answering for one CPU "device"."""

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "vllm_omni.worker.gpu_ar_worker.GPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend=None, head_size=0, allow_trtllm_default=False,
                                       *args, **kwargs) -> str:
        return ATTENTION

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank=None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        # TEST SUPPORT: a multi-rank server needs as many "devices" as ranks (OMNI_SERVING_TEST_DEVICE_COUNT).
        return int(os.environ.get(DEVICE_COUNT, "1"))

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        # TEST SUPPORT: what the worker measures around its model load -- this process's resident memory.
        return _rss(cls, device)

    @classmethod
    def get_device_version(cls):
        return None

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device=None) -> int:
        return _memory()[0]

    @classmethod
    def get_device_memory(cls, device=None):
        return _memory()

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return _memory()[1]

    @classmethod
    def mem_get_info(cls, device=None):
        return _memory()

    # Peak-memory and cache calls the diffusion worker makes on an accelerator: nothing to do on CPU.
    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def reset_peak_memory_stats(cls, device=None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def set_device(cls, device) -> None:
        return None

    @classmethod
    def current_device(cls) -> int:
        return 0

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def record_device_event(cls):
        return None

    @classmethod
    def is_fully_connected(cls, device_ids) -> bool:
        return False
