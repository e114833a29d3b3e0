"""Run the REAL ``vllm_omni/diffusion/lora/loader.py`` of a vllm-omni release with torch alone.

:func:`loader_sandbox` builds (once per version, cached next to the wheels) a directory holding

* ``vllm_omni/diffusion/lora/loader.py`` copied byte for byte from the PyPI wheel,
* a minimal ``vllm_omni-<version>.dist-info`` (so ``importlib.metadata.version("vllm-omni")`` answers),
* small stubs for everything the real file imports: ``vllm.logger``, ``diffusers.loaders.
  lora_conversion_utils``, ``huggingface_hub``, ``safetensors.torch``, ``vllm_omni.diffusion.utils.
  tf_utils``, ``vllm_omni.transformers_utils.repo_utils`` (0.29+), ``vllm_omni.diffusion.distributed.
  utils`` (0.30+ imports ``get_local_device``; stubbed for every version so a backport can use it),
  and empty ``__init__`` files (the real ``vllm_omni/__init__`` and ``lora/__init__`` pull in vLLM).

With that directory first on ``sys.path``, ``import vllm_omni.diffusion.lora.loader`` imports the
real file (~0.5-1.5 s here, torch import included) and ``LoraLoaderMixin.load_lora_into_module`` /
``unload_module_lora`` run on any small ``torch.nn.Module``.

The stubs shadow real ``vllm``/``diffusers``/``huggingface_hub``/``safetensors`` packages, so use
the sandbox in a subprocess (:func:`run_sandboxed`, :func:`sandbox_env`), not in the pytest process.

``get_local_device()`` stub (``vllm_omni.diffusion.distributed.utils``): returns
``torch.device(LOCAL_DEVICE)`` where the module attribute ``LOCAL_DEVICE`` wins when not None,
else env ``OMNI_TEST_LOCAL_DEVICE`` (read at call time), default ``"cpu"``. Like the real one it
answers ``"cuda:0"``/``"npu:0"`` whether or not such a device exists. ``CALLS`` counts its calls
(upstream 0.30 calls it once per load/unload call).

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

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

from omni_patches.testing import run_code

from .fakes import write_dist_info

REPO_ROOT = Path(__file__).resolve().parents[2]
LOADER_RELPATH = "vllm_omni/diffusion/lora/loader.py"
DEVICE_ENV = "OMNI_TEST_LOCAL_DEVICE"

# Every module a known loader.py version imports (besides stdlib and torch). ``_check_imports`` fails
# the sandbox build loudly if a new upstream version imports something that is not covered here.
_STUBS: dict[str, str] = {
    "vllm/__init__.py": '"""Stub of vLLM for the omni-patches loader sandbox."""\n__version__ = "{vllm_version}"\n',
    "vllm/logger.py": '''
        import logging


        def init_logger(name):
            return logging.getLogger(name)
        ''',
    "diffusers/__init__.py": '"""Stub."""\n',
    "diffusers/loaders/__init__.py": '"""Stub."""\n',
    "diffusers/loaders/lora_conversion_utils.py": '''
        def _convert_non_diffusers_qwen_lora_to_diffusers(state_dict):
            raise NotImplementedError("stub: non-diffusers Qwen LoRA conversion is not available in the sandbox")


        def _convert_non_diffusers_wan_lora_to_diffusers(state_dict):
            raise NotImplementedError("stub: non-diffusers Wan LoRA conversion is not available in the sandbox")
        ''',
    "huggingface_hub/__init__.py": '''
        def hf_hub_download(repo_id, filename=None, **kwargs):
            raise OSError(f"stub huggingface_hub: no network ({repo_id}/{filename})")


        class HfApi:
            def __init__(self, **kwargs):
                self.kwargs = kwargs

            def hf_hub_download(self, repo_id, filename=None, **kwargs):
                return hf_hub_download(repo_id, filename, **kwargs)
        ''',
    "safetensors/__init__.py": '"""Stub."""\n',
    "safetensors/torch.py": '''
        """Stub: ``save_file``/``load_file`` round-trip through torch.save (NOT the safetensors format)."""
        import torch


        def save_file(tensors, filename, metadata=None):
            torch.save(dict(tensors), filename)


        def load_file(filename, device="cpu"):
            return torch.load(filename, map_location=device, weights_only=True)
        ''',
    "vllm_omni/__init__.py": 'from .version import __version__, __version_tuple__  # noqa: F401\n',
    "vllm_omni/version.py": '__version__ = "{version}"\n__version_tuple__ = {version_tuple}\n',
    "vllm_omni/diffusion/__init__.py": "",
    "vllm_omni/diffusion/lora/__init__.py": "",
    "vllm_omni/diffusion/utils/__init__.py": "",
    "vllm_omni/diffusion/utils/tf_utils.py": '''
        def get_transformer_from_pipeline(pipeline, transformer_name="transformer"):
            return getattr(pipeline, transformer_name, None)
        ''',
    "vllm_omni/transformers_utils/__init__.py": "",
    "vllm_omni/transformers_utils/repo_utils.py": '''
        from huggingface_hub import HfApi

        _hf_api = None


        def hf_api():
            global _hf_api
            if _hf_api is None:
                _hf_api = HfApi(library_name="vllm-omni")
            return _hf_api
        ''',
    "vllm_omni/diffusion/distributed/__init__.py": "",
    "vllm_omni/diffusion/distributed/utils.py": '''
        """Stub of omni's distributed utils: a controllable ``get_local_device``."""
        import os

        import torch

        #: when not None, wins over the env var
        LOCAL_DEVICE = None
        #: number of get_local_device() calls
        CALLS = 0


        def get_local_device() -> torch.device:
            global CALLS
            CALLS += 1
            spec = LOCAL_DEVICE if LOCAL_DEVICE is not None else os.environ.get("{device_env}", "cpu")
            return torch.device(spec)
        ''',
}

_ALLOWED_ROOTS = {"torch", "os", "collections", "typing", "re", "functools", "itertools", "dataclasses",
                  "logging", "__future__", "contextlib", "math", "abc", "enum", "json", "pathlib"}


def _version_tuple(version: str) -> tuple:
    from packaging.version import Version

    v = Version(version)
    return tuple(v.release) + ((f"{v.pre[0]}{v.pre[1]}",) if v.pre else ())


def _render(version: str) -> dict[str, str]:
    rel = _version_tuple(version)
    fmt = {
        "version": version,
        "version_tuple": rel,
        "vllm_version": f"{rel[0]}.{rel[1]}.0",
        "device_env": DEVICE_ENV,
    }
    out = {}
    for path, src in _STUBS.items():
        src = textwrap.dedent(src).lstrip("\n")
        # only substitute our own placeholders (stub bodies contain f-string braces)
        for k, v in fmt.items():
            src = src.replace("{" + k + "}", str(v) if k != "version_tuple" else repr(v))
        out[path] = src
    return out


def _check_imports(loader_src: str, stubs: dict[str, str]) -> None:
    import ast

    stubbed = {p[:-3].replace("/", ".").removesuffix(".__init__") for p in stubs}
    for node in ast.walk(ast.parse(loader_src)):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = [node.module]
        for m in mods:
            if m.split(".")[0] in _ALLOWED_ROOTS or m in stubbed:
                continue
            raise RuntimeError(f"loader.py imports {m!r}, which the sandbox does not stub; extend _STUBS")


def loader_sandbox(version: str) -> Path:
    """Directory to put first on ``sys.path`` to import the real ``loader.py`` of vllm-omni ``version``."""
    from .wheels import real_file, sandbox  # lazy: keeps pytest out of sandboxed subprocesses

    real = real_file("vllm-omni", version, LOADER_RELPATH)
    loader_src = real.read_text()
    stubs = _render(version)

    def fill(tmp: Path) -> None:
        _check_imports(loader_src, stubs)
        for rel, src in stubs.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(src)
        shutil.copyfile(real, tmp / LOADER_RELPATH)
        write_dist_info(tmp, "vllm-omni", version, "vllm_omni")

    recipe = "\0".join([loader_src, *(f"{k}\0{stubs[k]}" for k in sorted(stubs))])
    return sandbox(f"omni-loader-{version}", recipe, fill)


def sandbox_env(version: str, *, local_device: str | None = None, fake_npu_broken: bool = False,
                extra: dict | None = None) -> dict[str, str]:
    """Environment for a subprocess: sandbox first on PYTHONPATH, then tests/ (``support``) and the repo root
    (the package under test importable), optional ``get_local_device()`` answer."""
    env = dict(os.environ)
    parts = [str(loader_sandbox(version)), str(REPO_ROOT / "tests"), str(REPO_ROOT)]
    src = REPO_ROOT / "src"
    if src.is_dir():
        parts.append(str(src))
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
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
