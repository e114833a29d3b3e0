"""A simulated ``npu`` accelerator for CPU-only torch (TARGETS.md §1).

Built on torch's experimental Python PrivateUse1 backend: the backend is renamed to ``npu``
and a handful of aten kernels are registered for it. Every npu tensor is a plain ``torch.Tensor``
on device ``npu:0`` made by ``torch._C._acc.create_empty_tensor`` (zero-byte storage) whose data is
a CPU tensor attached to that storage object (see :func:`raw`); kernels unwrap, compute on CPU and
wrap again, counting what they do.

Registration is process-global and irreversible, and it must happen *after* any
``vllm_omni`` import (omni's platform detection would otherwise see ``torch.npu`` and try
to import vllm_ascend). So: call :func:`install` only inside a subprocess (or a dedicated
worker process), never in the pytest process itself.

Usage (inside the subprocess)::

    import vllm_omni.diffusion.lora.loader as loader   # first
    from support import fake_npu
    fake_npu.install()                 # or install(broken=True): probe allocations fail
    ...
    fake_npu.counters()  # {'npu_matmuls': 3, 'h2d_bytes': ..., 'd2h_bytes': ..., ...}

Supported on npu tensors: ``torch.empty``/``empty_strided``/``empty_like``/``zeros``,
``.to("npu")``/``.to("cpu")``/``.cpu()``/``copy_`` (both directions, dtype conversion),
``torch.matmul``/``mm``/``addmm``/``bmm``, ``t``/``transpose``/``view``/``reshape``/``contiguous``,
``torch.cat``/``concat``, ``add``/``sub``/``mul`` (+ in-place and ``addmm_``), ``fill_``/``zero_``,
``detach``/``clone``. Anything else raises ``NotImplementedError`` from the dispatcher, which is
what a test should see if code does something unexpected on the device. Move tensors to CPU
before comparing them (``torch.testing`` needs many more ops).

``broken=True`` (or env ``FAKE_NPU_BROKEN=1`` at install time, or ``set_broken(True)`` later)
makes every npu allocation raise ``RuntimeError`` -- the ``torch.empty(1, device="npu:0")``
probe of upstream's ``_resolve_lora_compute_device`` then fails and callers must fall back
to CPU.
"""
from __future__ import annotations

import os
import threading

import torch

DEVICE = "npu"

_lock = threading.Lock()
_installed = False
_broken = False
_counters: dict[str, int] = {}
_libs: list = []  # keep torch.library.Library objects alive


def _reset_dict() -> dict[str, int]:
    return {
        "npu_matmuls": 0,  # mm / addmm / bmm / addmm_ executed on npu
        "npu_alloc_failures": 0,  # allocations refused in broken mode
        "h2d_copies": 0,
        "h2d_bytes": 0,
        "d2h_bytes": 0,
    }


_counters = _reset_dict()


def counters() -> dict[str, int]:
    """A snapshot of the global counters (process-wide, since install or the last reset)."""
    with _lock:
        return dict(_counters)


def reset_counters() -> None:
    global _counters
    with _lock:
        _counters = _reset_dict()


def set_broken(flag: bool = True) -> None:
    """Toggle broken mode at runtime: every npu allocation raises RuntimeError."""
    global _broken
    _broken = bool(flag)


def _bump(key: str, n: int = 1) -> None:
    with _lock:
        _counters[key] += n


_RAW_ATTR = "_fake_npu_raw"


def raw(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding the data of npu tensor ``t``.

    The data hangs off the wrapper's (zero-byte) storage object, which torch preserves for
    as long as the storage lives, so ``.data``, ``detach()`` and ``nn.Parameter`` aliases of
    the same tensor all see it.
    """
    try:
        return getattr(t.untyped_storage(), _RAW_ATTR)
    except AttributeError:
        raise RuntimeError("fake npu: tensor has no backing data (made by an unsupported op?)") from None


def _wrap(data: torch.Tensor) -> torch.Tensor:
    res = torch._C._acc.create_empty_tensor(list(data.shape), data.dtype)
    setattr(res.untyped_storage(), _RAW_ATTR, data)
    return res


def _unwrap(x):
    if isinstance(x, torch.Tensor) and x.device.type == DEVICE:
        return raw(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(i) for i in x)
    return x


def _is_npu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == DEVICE


def _alloc(size, dtype, stride=None) -> torch.Tensor:
    if _broken:
        _bump("npu_alloc_failures")
        raise RuntimeError("fake npu (broken mode): device allocation failed")
    dtype = dtype or torch.get_default_dtype()
    data = torch.empty_strided(size, stride, dtype=dtype) if stride is not None else torch.empty(size, dtype=dtype)
    return _wrap(data)


def install(*, broken: bool | None = None) -> None:
    """Register the ``npu`` PrivateUse1 backend and its kernels (idempotent; process-global)."""
    global _installed
    if broken is None:
        broken = os.environ.get("FAKE_NPU_BROKEN", "") not in ("", "0")
    set_broken(broken)
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(DEVICE)
    key = "PrivateUse1"
    lib = torch.library.Library("aten", "IMPL")
    _libs.append(lib)

    def reg(name):
        def deco(fn):
            lib.impl(name, fn, key)
            return fn

        return deco

    # --- allocation -------------------------------------------------------------------
    @reg("empty.memory_format")
    def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return _alloc(size, dtype)

    @reg("empty_strided")
    def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
        return _alloc(size, dtype, stride)

    # --- host <-> device copies ---------------------------------------------------------
    @reg("_copy_from")
    def _copy_from(src, dst, non_blocking=False):
        src_npu, dst_npu = _is_npu(src), _is_npu(dst)
        src_raw = raw(src) if src_npu else src
        nbytes = src_raw.numel() * src_raw.element_size()
        if src_npu and not dst_npu:
            _bump("d2h_bytes", nbytes)
            dst.copy_(src_raw)
        else:
            if not src_npu:
                _bump("h2d_copies")
                _bump("h2d_bytes", nbytes)
            raw(dst).copy_(src_raw)
        return dst

    @reg("copy_")
    def _copy_(dst, src, non_blocking=False):
        return _copy_from(src, dst)

    # --- matmuls (counted) --------------------------------------------------------------
    @reg("mm")
    def _mm(a, b):
        _bump("npu_matmuls")
        return _wrap(torch.mm(raw(a), raw(b)))

    @reg("bmm")
    def _bmm(a, b):
        _bump("npu_matmuls")
        return _wrap(torch.bmm(raw(a), raw(b)))

    @reg("addmm")
    def _addmm(inp, a, b, *, beta=1, alpha=1):
        _bump("npu_matmuls")
        return _wrap(torch.addmm(_unwrap(inp), raw(a), raw(b), beta=beta, alpha=alpha))

    @reg("addmm_")
    def _addmm_(inp, a, b, *, beta=1, alpha=1):
        _bump("npu_matmuls")
        raw(inp).addmm_(raw(a), raw(b), beta=beta, alpha=alpha)
        return inp

    # --- shape / view ops (results wrap CPU views of .raw, so in-place writes propagate) --
    @reg("view")
    def _view(a, size):
        return _wrap(raw(a).view(size))

    @reg("_unsafe_view")
    def _unsafe_view(a, size):
        return _wrap(raw(a).reshape(size))

    @reg("t")
    def _t(a):
        return _wrap(raw(a).t())

    @reg("transpose.int")
    def _transpose(a, d0, d1):
        return _wrap(raw(a).transpose(d0, d1))

    @reg("expand")
    def _expand(a, size, *, implicit=False):
        return _wrap(raw(a).expand(size))

    @reg("as_strided")
    def _as_strided(a, size, stride, storage_offset=None):
        return _wrap(raw(a).as_strided(size, stride, storage_offset))

    @reg("clone")
    def _clone(a, *, memory_format=None):
        return _wrap(raw(a).clone())

    @reg("cat")
    def _cat(tensors, dim=0):
        return _wrap(torch.cat([raw(t) for t in tensors], dim))

    # --- elementwise --------------------------------------------------------------------
    def _check_same_device(*ts):
        for t in ts:
            if isinstance(t, torch.Tensor) and not _is_npu(t) and t.dim() > 0:
                raise RuntimeError(f"fake npu: expected all tensors on npu, got one on {t.device}")

    @reg("add.Tensor")
    def _add(a, b, *, alpha=1):
        _check_same_device(a, b)
        return _wrap(torch.add(raw(a), _unwrap(b), alpha=alpha))

    @reg("sub.Tensor")
    def _sub(a, b, *, alpha=1):
        _check_same_device(a, b)
        return _wrap(torch.sub(raw(a), _unwrap(b), alpha=alpha))

    @reg("mul.Tensor")
    def _mul(a, b):
        _check_same_device(a, b)
        return _wrap(torch.mul(_unwrap(a), _unwrap(b)))

    @reg("mul.Scalar")
    def _mul_s(a, s):
        return _wrap(raw(a) * s)

    @reg("add_.Tensor")
    def _add_(a, b, *, alpha=1):
        _check_same_device(a, b)
        raw(a).add_(_unwrap(b), alpha=alpha)
        return a

    @reg("sub_.Tensor")
    def _sub_(a, b, *, alpha=1):
        _check_same_device(a, b)
        raw(a).sub_(_unwrap(b), alpha=alpha)
        return a

    @reg("fill_.Scalar")
    def _fill_(a, v):
        raw(a).fill_(v)
        return a

    @reg("zero_")
    def _zero_(a):
        raw(a).zero_()
        return a

    _installed = True
