"""The REAL ``vllm_ascend/ops/fused_moe/prepare_finalize.py`` of every vllm-ascend release, importable on CPU.

What is real: that file, byte for byte, from the release's PyPI wheel or sdist (``support.wheels``).
What is ours (everything it imports; it needs none of it for the AllGather DP/PCP path):

* ``torch_npu`` and ``torch.npu``: MagicMocks (``torch.npu.Stream`` a class, for an annotation), as
  vllm-ascend's own CPU unit tests do;
* ``vllm.distributed.parallel_state.get_dp_group`` / ``get_pcp_group``: the :class:`Coordinator` objects a
  test installs with :func:`set_groups` (real gloo groups in :mod:`ascend_finalize_world`);
* ``vllm.forward_context.get_forward_context()`` (0.13-0.16) and ``vllm_ascend.ascend_forward_context._EXTRA_CTX``
  (0.17+): one object, :data:`FORWARD`, carrying ``max_tokens_across_dp`` / ``max_tokens_across_pcp``;
* ``vllm_ascend.utils``: ``enable_sp`` / ``enable_sp_by_pass`` False (the DP path), ``prefill_context_parallel_enable``
  reads :data:`FLAGS` (0.13-0.20 gate the PCP steps on it);
* ``get_ascend_config()``: every option off; ``MoEPrepareOutput``: a record of its keyword arguments;
  any other name: an auto-generated stand-in (CamelCase: a permissive class; else a MagicMock).

The behaviour of those stand-ins is one table (:func:`overrides`), delivered two ways (``omni_patches.testing``'s
one stand-in mechanism):

* :func:`load(version)` -- in this process, under the real module name (replacing any previous one): a
  ``standins.Finder`` serves the stand-ins from memory (several releases loaded one after another, in the
  in-process tests and the matrix world);
* :func:`release(version)` -- the :class:`~omni_patches.testing.Release` for a fresh interpreter (contract test,
  engine-activated worlds; :func:`sandbox_dir` builds it): the real file at its real path, a
  ``vllm_ascend-<version>.dist-info`` (the engine's version gate reads it), stand-in files whose source takes the
  same table. tests/ must be on ``sys.path``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

from packaging.version import Version

from omni_patches.testing import Release
from omni_patches.testing.standins import Finder
from support import wheels

TARGET = "vllm_ascend.ops.fused_moe.prepare_finalize"
REL = "vllm_ascend/ops/fused_moe/prepare_finalize.py"
PATCH_ID = "ascend-allgather-finalize-order"

# Every vllm-ascend release on PyPI with this file, by what its _finalize_with_dp_group does (checked against
# each release file; test_allgather_finalize.py re-checks the list from the files every run).
AFFECTED = ["0.13.0rc1", "0.13.0rc2", "0.13.0rc3", "0.13.0", "0.14.0rc1", "0.15.0rc1", "0.16.0rc1", "0.17.0rc1",
            "0.18.0rc1", "0.18.0", "0.19.1rc1", "0.20.2rc1", "0.21.0rc1", "0.22.1rc1", "0.23.0rc1", "0.23.0",
            "0.23.0.post1"]
FIXED = ["0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2"]
OUT_OF_RANGE = ["0.12.0rc1"]  # same bug, plus a trailing TP all-reduce in the method: not covered
FIRST_FIXED = "0.24.0rc1"

# Below 0.18.0 the sdists (2.5-5 MB; the wheels are 10-27 MB): no other test uses those releases. From 0.18.0
# on, whatever release_root() picks, shared with the other vllm-ascend tests.
_SDIST_BELOW = Version("0.18.0")


# No wheel on PyPI at all: asking pip first (release_root) costs a failed `pip download` per call.
_SDIST_ONLY = {"0.23.0.post1"}
_SDIST_ONLY_FROM = Version("0.27.0")


def _sdist(version: str) -> bool:
    v = Version(version)
    return v < _SDIST_BELOW or v >= _SDIST_ONLY_FROM or version in _SDIST_ONLY


@functools.lru_cache(maxsize=None)
def release_dir(version: str) -> Path:
    """Unpacked real files of ``vllm-ascend==version`` (skips the test when offline, unless CI is set)."""
    if _sdist(version):
        return wheels.fetch_or_skip("vllm-ascend", version, sdist=True)
    try:
        return wheels.release_root("vllm-ascend", version)
    except RuntimeError:
        return wheels.fetch_or_skip("vllm-ascend", version, sdist=True)


def real_file(version: str) -> Path:
    path = release_dir(version) / REL
    if not path.exists():
        raise FileNotFoundError(f"{REL} is not in vllm-ascend {version}")
    return path


# --------------------------------------------------------------------------------------------------
# stand-ins (our code)
# --------------------------------------------------------------------------------------------------
class Flags:
    context_parallel = True  # what prefill_context_parallel_enable() answers (0.13-0.20)


class Forward:
    """Both forward contexts the releases read (vLLM's get_forward_context() and vllm-ascend's _EXTRA_CTX)."""

    max_tokens_across_dp = 0
    max_tokens_across_pcp = 0
    in_profile_run = False
    flash_comm_v1_enabled = False


FLAGS = Flags()
FORWARD = Forward()
_GROUPS: dict[str, Any] = {}


def set_groups(dp, pcp) -> None:
    """What ``get_dp_group()`` / ``get_pcp_group()`` return from now on."""
    _GROUPS["dp"], _GROUPS["pcp"] = dp, pcp


def _group(kind):
    def get():
        group = _GROUPS.get(kind)
        if group is None:
            raise AssertionError(f"{kind} group is not initialized")
        return group

    get.__name__ = f"get_{kind}_group"
    return get


class _Off:
    """``get_ascend_config()``: every option off."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return False


class Record:
    """``MoEPrepareOutput``: keeps its keyword arguments as attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


@contextlib.contextmanager
def _no_stream(*args: Any, **kwargs: Any):
    yield


def overrides() -> dict[str, dict[str, Any]]:
    """``{module: {name: value}}``: the behaviour of the stand-ins (see the module docstring)."""
    return {
        "vllm.distributed.parallel_state": {
            "get_dp_group": _group("dp"), "get_pcp_group": _group("pcp"),
            "get_tensor_model_parallel_rank": lambda: 0, "get_tensor_model_parallel_world_size": lambda: 1},
        "vllm.forward_context": {"get_forward_context": lambda: FORWARD},
        "vllm_ascend.ascend_forward_context": {"_EXTRA_CTX": FORWARD},
        "vllm_ascend.ascend_config": {"get_ascend_config": lambda: _Off()},
        "vllm_ascend.utils": {
            "enable_sp": lambda *a, **k: False, "enable_sp_by_pass": lambda *a, **k: False,
            "npu_stream_switch": _no_stream, "prefill_context_parallel_enable": lambda: FLAGS.context_parallel},
        "vllm_ascend.ops.fused_moe.moe_runtime_args": {"MoEPrepareOutput": Record},
        "vllm_ascend.ops.fused_moe.dataclass.prepare_finalize": {"MoEPrepareOutput": Record},
    }


_ROOTS = ("vllm", "vllm_ascend", "torch_npu")


def ensure_torch_npu() -> None:
    import torch

    if not hasattr(torch, "npu"):
        npu = MagicMock(name="torch.npu")
        npu.Stream = type("Stream", (), {})
        torch.npu = npu


def install_finder(root: Path | None = None) -> Finder:
    """Stand-ins for every ``vllm``/``vllm_ascend``/``torch_npu`` module that ``root`` does not hold as a file (once,
    behind the import-hook finders of wrapt / omni_patches), with the behaviour of :func:`overrides`."""
    finder = Finder("ascend-finalize", _ROOTS, root, overrides).add()
    ensure_torch_npu()
    return finder


def load(version: str, path: Path | None = None) -> types.ModuleType:
    """Import the real file of ``version`` (or ``path``) as ``vllm_ascend.ops.fused_moe.prepare_finalize``."""
    install_finder()
    path = path or real_file(version)
    sys.modules.pop(TARGET, None)
    spec = importlib.util.spec_from_file_location(TARGET, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[TARGET] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------
# release environments (fresh interpreters: contract, engine-activated worlds)
# --------------------------------------------------------------------------------------------------
# The stand-in files: the package runs ensure_torch_npu() (an annotation reads torch.npu.Stream), each module of
# overrides() takes its entries from there (one table; the objects a test configures live in this module).
STANDINS = {"vllm_ascend": f"from {__name__} import ensure_torch_npu\n\nensure_torch_npu()\n",
            **{mod: f"from {__name__} import overrides\n\nglobals().update(overrides()[{mod!r}])\n"
               for mod in overrides()}}


@functools.lru_cache(maxsize=None)
def release(version: str, metadata_version: str | None = None) -> Release:
    """The real ``prepare_finalize.py`` of ``version``; its dist-info says ``metadata_version``."""
    return Release("vllm-ascend", version, files=[REL], sdist=_sdist(version), auto_standins=True,
                   passthrough=("torch",), metadata_version=metadata_version, standins=STANDINS)


def sandbox_dir(version: str, *, metadata_version: str | None = None) -> Path:
    """The built :func:`release` (skips the test when offline, unless CI is set)."""
    release_dir(version)  # fetched, or skipped
    return release(version, metadata_version).directory()


# --------------------------------------------------------------------------------------------------
# vLLM-style group coordinator over a real torch.distributed (gloo) group
# --------------------------------------------------------------------------------------------------
TRACE: list = []  # (group name, collective, input shape) of every collective, in call order


class Coordinator:
    """The two collectives the AllGather path calls on vLLM's ``GroupCoordinator``, with its semantics:
    ``all_gather(x, dim)`` concatenates the members' tensors along ``dim`` in rank order;
    ``reduce_scatter(x, dim)`` sums the members' tensors and gives member i the i-th of ``world_size`` equal
    chunks along ``dim`` (vLLM's ``DeviceCommunicatorBase`` asserts the length divides). Implemented with
    torch.distributed's ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on a gloo group -- the same
    collectives vLLM's device communicator issues (HCCL on Ascend)."""

    def __init__(self, name: str, ranks: list[int], group, rank: int) -> None:
        self.name, self.ranks, self.device_group = name, list(ranks), group
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(rank)

    def all_gather(self, x, dim: int = -1):
        import torch
        import torch.distributed as dist

        TRACE.append((self.name, "all_gather", list(x.shape)))
        if self.world_size == 1:
            return x
        dim %= x.dim()
        inp = x.movedim(dim, 0).contiguous()
        out = torch.empty((self.world_size * inp.shape[0], *inp.shape[1:]), dtype=inp.dtype)
        dist.all_gather_into_tensor(out, inp, group=self.device_group)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, x, dim: int = -1):
        import torch
        import torch.distributed as dist

        TRACE.append((self.name, "reduce_scatter", list(x.shape)))
        if self.world_size == 1:
            return x
        dim %= x.dim()
        inp = x.movedim(dim, 0).contiguous()
        if inp.shape[0] % self.world_size:
            raise AssertionError(f"reduce_scatter over {self.name}: {inp.shape[0]} rows do not split into "
                                 f"{self.world_size} equal chunks")
        out = torch.empty((inp.shape[0] // self.world_size, *inp.shape[1:]), dtype=inp.dtype)
        dist.reduce_scatter_tensor(out, inp, group=self.device_group)
        return out.movedim(0, dim).contiguous()
