"""Run the REAL ``vllm_omni/diffusion/lora/loader.py`` of a vllm-omni release with torch alone.

:func:`release` is a :class:`~omni_patches.testing.Release` of that one file, byte for byte from the PyPI wheel,
with its dist-info, and stand-ins (the one mechanism) for what it imports: ours with behaviour where the loader's
result depends on it (:data:`STANDINS`), permissive ones for the rest (diffusers' converters of non-diffusers
formats, huggingface_hub: never reached by a local state dict). With its directory first on ``sys.path``,
``import vllm_omni.diffusion.lora.loader`` imports the real file (~0.5-1.5 s here, torch import included) and
``LoraLoaderMixin.load_lora_into_module`` / ``unload_module_lora`` run on any small ``torch.nn.Module``. The
stand-ins shadow real packages: use it in a child (:func:`run_sandboxed`, :func:`sandbox_env`, the contract).

``get_local_device()`` (``vllm_omni.diffusion.distributed.utils``, imported by 0.30+; there for every version so
that a backport can use it): ``torch.device(LOCAL_DEVICE)`` where the module attribute ``LOCAL_DEVICE`` wins when
not None, else env ``OMNI_TEST_LOCAL_DEVICE`` (read at call time), default ``"cpu"``. Like the real one it answers
``"cuda:0"`` / ``"npu:0"`` whether or not such a device exists. ``CALLS`` counts its calls (upstream 0.30 calls it
once per load/unload call).

How the loader maps state-dict keys to parameters (identical 0.27.0rc1 .. 0.32.0rc1 except where noted)
------------------------------------------------------------------------------------------------
* It walks ``module.named_parameters(prefix)`` (prefix passed positionally, so names look like
  ``"transformer.blocks.0.attn.to_q.weight"``; ``prefix=""`` gives bare names). Only names ending in
  ``.weight`` / ``.bias`` are considered; ``base_key`` = the name without that suffix.
* weight: keys ``f"{base_key}.{lora_a_suffix}"`` (A, shape ``(rank, in)``) and
  ``f"{base_key}.{lora_b_suffix}"`` (B, ``(out, rank)``); delta = ``torch.matmul(B, A)``; the
  parameter gets ``+= delta`` (load) / ``-= delta`` (unload) after ``delta.to(param.device, param.dtype)``.
  No alpha/scale is applied here (Diffusers ``.alpha`` is folded into B earlier, by the pipeline mixin).
* bias: key ``f"{base_key}.{lora_bias_suffix}"`` (default suffix ``"bias"``, i.e. the same name as the
  parameter!) holds the delta itself (no matmul). Any ``.bias`` parameter whose name is in the dict gets it.
* stacked params: ``param_to_weight_names`` is built from the TOP-LEVEL ``module.stacked_params_mapping``
  (list of ``(param_name, weight_name, shard_id)``, e.g. ``(".to_qkv", ".to_q", "q")``). For a base key
  matched by ``param_name`` (0.27/0.28: substring ``param_name in base_key`` and ALL matching mappings
  stack, ``continue``; 0.29+: ``base_key.endswith(param_name)``, first match only, ``break``) the keys are
  ``base_key.replace(param_name, weight_name) + "." + suffix`` per weight name, in mapping order; the
  per-shard deltas are concatenated along dim 0 (``torch.concat``). If any shard's key is missing the
  whole param is skipped. Bias shards work the same way (no matmul).
* Keys never used are logged as ``Missing loading lora key`` warnings; the return value is the set of used keys.
"""
from __future__ import annotations

import functools
import os
import subprocess
import textwrap
from pathlib import Path

from omni_patches.testing import VLLM_LOGGER, Release, run_code

REPO_ROOT = Path(__file__).resolve().parents[2]
LOADER_RELPATH = "vllm_omni/diffusion/lora/loader.py"
DEVICE_ENV = "OMNI_TEST_LOCAL_DEVICE"

STANDINS = {
    "vllm.logger": VLLM_LOGGER,
    "safetensors.torch": '''
        """``save_file``/``load_file`` round-trip through torch.save (NOT the safetensors format)."""
        import torch


        def save_file(tensors, filename, metadata=None):
            torch.save(dict(tensors), filename)


        def load_file(filename, device="cpu"):
            return torch.load(filename, map_location=device, weights_only=True)
        ''',
    "vllm_omni.diffusion.utils.tf_utils": '''
        def get_transformer_from_pipeline(pipeline, transformer_name="transformer"):
            return getattr(pipeline, transformer_name, None)
        ''',
    "vllm_omni.diffusion.distributed.utils": f'''
        import os

        import torch

        LOCAL_DEVICE = None  # when not None, wins over the env var
        CALLS = 0  # get_local_device() calls


        def get_local_device() -> torch.device:
            global CALLS
            CALLS += 1
            return torch.device(LOCAL_DEVICE if LOCAL_DEVICE is not None else os.environ.get("{DEVICE_ENV}", "cpu"))
        ''',
}


@functools.cache
def release(version: str) -> Release:
    """The real ``loader.py`` of vllm-omni ``version`` with :data:`STANDINS`."""
    return Release("vllm-omni", version, files=[LOADER_RELPATH], standins=STANDINS, auto_standins=True,
                   passthrough=("torch",))


def sandbox_env(version: str, *, local_device: str | None = None, fake_npu_broken: bool = False,
                extra: dict | None = None) -> dict[str, str]:
    """Environment for a subprocess: sandbox first on PYTHONPATH, then tests/ (``support``) and the repo root
    (the package under test importable), optional ``get_local_device()`` answer."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*release(version).paths(), str(REPO_ROOT / "tests"), str(REPO_ROOT),
                                         *filter(None, [env.get("PYTHONPATH")])])
    if local_device is not None:
        env[DEVICE_ENV] = local_device
    if fake_npu_broken:
        env["FAKE_NPU_BROKEN"] = "1"
    env.update(extra or {})
    return env


def run_sandboxed(version: str, script: str, *, timeout: float = 120, check: bool = True,
                  **env_kw) -> subprocess.CompletedProcess:
    """Run ``script`` (Python source, dedented) in an interpreter of its own (``testing.run_code``) inside the sandbox.

    ``env_kw`` goes to :func:`sandbox_env` (``local_device=``, ``fake_npu_broken=``, ``extra=``).
    With ``check`` a non-zero exit raises AssertionError carrying stdout/stderr.
    """
    proc = run_code(textwrap.dedent(script), env=sandbox_env(version, **env_kw), timeout=timeout, cwd=str(REPO_ROOT))
    if check and proc.returncode != 0:
        raise AssertionError(f"sandboxed script failed (rc={proc.returncode})\n--- stdout\n{proc.stdout}"
                             f"\n--- stderr\n{proc.stderr}")
    return proc


# ----------------------------------------------------------------------------------------------
# tiny LoRA state dicts (usable in or out of the sandbox; torch only)
# ----------------------------------------------------------------------------------------------

def _stacked(module) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for param_name, weight_name, _ in getattr(module, "stacked_params_mapping", ()) or ():
        out.setdefault(param_name, []).append(weight_name)
    return out


def _shards(base_key: str, stacked: dict[str, list[str]]):
    """``(param_name, weight_names)`` of the mapping that applies, unambiguous under both 0.28 and 0.29+
    matching rules, else None."""
    hits = [(p, w) for p, w in stacked.items() if p in base_key]
    if not hits:
        return None
    if len(hits) > 1 or not base_key.endswith(hits[0][0]):
        raise ValueError(f"{base_key!r} matches stacked mappings {[h[0] for h in hits]} ambiguously "
                         "(0.28 substring vs 0.29+ endswith rules differ); rename the test module")
    return hits[0]


def tiny_transformer(hidden: int):
    """Two blocks with the LoRA targets of a diffusion transformer, at width ``hidden``: a stacked ``to_qkv``
    (shards q/k/v, declared in ``stacked_params_mapping`` as models do), ``to_out`` with a bias, ``ffn_up``
    without one."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.to_qkv = torch.nn.Linear(hidden, 3 * hidden)
            self.to_out = torch.nn.Linear(hidden, hidden)
            self.ffn_up = torch.nn.Linear(hidden, 2 * hidden, bias=False)

    class Model(torch.nn.Module):
        stacked_params_mapping = [(".to_qkv", ".to_q", "q"), (".to_qkv", ".to_k", "k"), (".to_qkv", ".to_v", "v")]

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

    return Model()


def make_lora_state_dict(module, rank: int = 2, prefix: str = "transformer", *, bias: bool = False,
                         targets=None, dtype=None, seed: int = 0, scale: float = 0.1,
                         lora_a_suffix: str = "lora_A.weight", lora_b_suffix: str = "lora_B.weight",
                         lora_bias_suffix: str = "bias") -> dict:
    """A random LoRA state dict that the real loader applies to EVERY 2-D ``.weight`` of ``module``
    (and every ``.bias`` when ``bias=True``), CPU tensors like a safetensors load.

    ``targets``: optional iterable of substrings; only parameters whose name contains one are covered.
    Stacked params (top-level ``module.stacked_params_mapping``) get one A/B pair per shard; the out dim
    is split evenly between shards. ``dtype`` defaults to each parameter's dtype.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    stacked = _stacked(module)
    sd: dict = {}
    for name, p in module.named_parameters(prefix):
        if targets is not None and not any(t in name for t in targets):
            continue
        if name.endswith(".weight") and p.dim() == 2:
            base, kind = name[: -len(".weight")], "w"
        elif bias and name.endswith(".bias") and p.dim() == 1:
            base, kind = name[: -len(".bias")], "b"
        else:
            continue
        dt = dtype or p.dtype
        hit = _shards(base, stacked)
        keys = [base] if hit is None else [base.replace(hit[0], w) for w in hit[1]]
        out = p.shape[0]
        if out % len(keys):
            raise ValueError(f"{name}: out dim {out} not divisible into {len(keys)} shards")
        rows = out // len(keys)
        for k in keys:
            if kind == "w":
                a = torch.randn(rank, p.shape[1], generator=g, dtype=torch.float32) * scale
                b = torch.randn(rows, rank, generator=g, dtype=torch.float32) * scale
                sd[f"{k}.{lora_a_suffix}"] = a.to(dt)
                sd[f"{k}.{lora_b_suffix}"] = b.to(dt)
            else:
                sd[f"{k}.{lora_bias_suffix}"] = (torch.randn(rows, generator=g) * scale).to(dt)
    return sd


def expected_deltas(state_dict: dict, module, prefix: str = "transformer", *,
                    lora_a_suffix: str = "lora_A.weight", lora_b_suffix: str = "lora_B.weight",
                    lora_bias_suffix: str = "bias") -> dict:
    """Independent float64 CPU reference: ``{param_name: delta}`` for every parameter the state dict
    (as built by :func:`make_lora_state_dict`) covers. Compare with ``param_after - param_before``."""
    import torch

    stacked = _stacked(module)
    out = {}
    for name, p in module.named_parameters(prefix):
        if name.endswith(".weight"):
            base, is_bias = name[: -len(".weight")], False
        elif name.endswith(".bias"):
            base, is_bias = name[: -len(".bias")], True
        else:
            continue
        hit = _shards(base, stacked)
        keys = [base] if hit is None else [base.replace(hit[0], w) for w in hit[1]]
        parts = []
        for k in keys:
            if is_bias:
                t = state_dict.get(f"{k}.{lora_bias_suffix}")
                if t is None:
                    break
                parts.append(t.double().cpu())
            else:
                a, b = state_dict.get(f"{k}.{lora_a_suffix}"), state_dict.get(f"{k}.{lora_b_suffix}")
                if a is None or b is None:
                    break
                parts.append(b.double().cpu() @ a.double().cpu())
        else:
            out[name] = torch.cat(parts)
    return out
