"""Kernels of ``lora-cpu-fused-delta`` (not a patch itself): ``W += sign * B @ A`` in place, rounding once.

* ``addmm``: ``W.addmm_(B, A, alpha=sign)`` in the weight's dtype. Fastest where the CPU multiplies that
  dtype natively (bf16: ``avx512_bf16``/``amx_bf16`` through oneDNN, aarch64 ``bf16``; fp16:
  ``avx512_fp16``/``amx_fp16``); elsewhere torch emulates the low-precision GEMM and it is barely faster
  than stock (Intel Xeon without avx512_bf16: 0.80-0.86 of stock).
* ``fp32``: row blocks of about :data:`BLOCK_BYTES` (per thread) in fp32:
  ``block = W[rows] -> fp32; block += B[rows] @ A``
  (fp32 GEMM, which every CPU runs at full speed), then one rounding back into ``W[rows]``. Extra memory:
  one block plus fp32 copies of ``A`` and ``B`` (rank-sized), never weight-sized.

Both round once (to the weight dtype, round-to-nearest-even), so the error against a float64 reference is
no larger than stock's ``W + round(B @ A)``. The kernel is chosen once per process and dtype, at first use
(:func:`kernel_for`): ``OMNI_PATCHES_LORA_CPU_FUSED_KERNEL`` if set, else the CPU's capability (cpuinfo
flags, the oneDNN ISA cap, torch's CPU capability) confirmed by a timed probe of both kernels on a small
LoRA-shaped problem (a few ms). fp32 (and wider) weights always use ``addmm``. Every torch op here runs on
the calling thread with torch's own intra-op threads (``torch.get_num_threads()``): no threads of our own.

Imports no torch at module level: patch modules must import without it (``omni-patches audit``).
"""
import os
import threading
import time

PATCH_ID = "lora-cpu-fused-delta"
ENV = "OMNI_PATCHES_LORA_CPU_FUSED_KERNEL"
CHOICES = ("auto", "addmm", "fp32")
LABELS = {"addmm": "addmm_ in {dtype}", "fp32": "fp32 row-blocked"}

# fp32 row blocks: 2.5 MiB per torch thread, i.e. 128 rows at width 5120 (Wan2.2-14B) on one thread, about
# one core's L2; narrower weights get more rows, wider ones fewer (at least MIN_BLOCK_ROWS). Scaling with the
# threads (up to BLOCK_THREADS) keeps each thread's share of the fp32 GEMM that size: with 2 threads, 128-row
# blocks took 40 ms per 5120x5120 bf16 layer and 256-row ones 28 ms (1 thread: 37-39 ms for 128-512 rows).
BLOCK_BYTES = 128 * 5120 * 4
BLOCK_THREADS = 4
MIN_BLOCK_ROWS = 16

# The probe: one LoRA-shaped problem (rank 64) small enough for a few ms. What it may decide:
# * native unit per cpuinfo: addmm_, unless fp32 was clearly faster twice (torch built without oneDNN, a
#   bf16 path that is not the native one): then fp32.
# * no native unit per cpuinfo (or oneDNN capped below it): fp32 whatever the probe says (it is reported).
#   An emulated GEMM looks as fast as fp32 at probe size but is not at full size: oneDNN emulating bf16
#   (capped to AVX512_CORE) allocates an fp32 copy of the whole weight per call (270 MiB for 13824x5120),
#   whose page faults make it 2x slower than the fp32 kernel there -- and a weight-sized temporary is what
#   this patch exists to avoid. On an oversubscribed host the probe is also biased towards addmm_: its one
#   parallel region waits for a descheduled thread once, the fp32 kernel's four wait four times (measured
#   here with 2 threads: 28 ms vs 8 ms, where 0.35 vs 0.28 ms is normal).
# * unknown CPU (no cpuinfo): the faster of two probes.
PROBE_SHAPE = (128, 2048, 64)  # rows, width, rank
PROBE_ROUNDS = 3
TO_FP32 = 0.8  # native capability, yet fp32 took < 0.8x addmm_'s time (twice): fp32
# Emulated low-precision GEMMs can be ~60x slower than fp32 (oneDNN capped to AVX2, fp16 without
# avx512_fp16): a first round that shows this decides at once instead of repeating a slow kernel.
DECISIVE = 8.0
DECISIVE_S = 2e-3

# oneDNN's ISA names in capability order (aliases map to their place). torch's bf16/fp16 CPU GEMMs go
# through oneDNN, which never uses more than ONEDNN_MAX_CPU_ISA (or the older DNNL_MAX_CPU_ISA) allows.
_ONEDNN_ISAS = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni",
                "avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx", "avx512_core_amx_fp16",
                "avx10_2_512", "avx10_2_512_amx_2")
_ONEDNN_ALIASES = {"avx10_1_512": "avx512_core_fp16", "avx10_1_512_amx": "avx512_core_amx",
                   "avx10_1_512_amx_fp16": "avx512_core_amx_fp16"}
# The least ISA (oneDNN) / the cpuinfo flags (x86, aarch64) with native dot products of each dtype.
_ONEDNN_NEEDS = {"bf16": "avx512_core_bf16", "fp16": "avx512_core_fp16"}
_X86_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
_ARM_FLAGS = {"bf16": ("bf16",), "fp16": ("asimdhp",)}

_lock = threading.Lock()
_chosen = {}  # torch dtype -> (kernel name, kernel function)
_pinned = {}  # torch dtype -> kernel name (pin(): the benchmark runs both kernels in one process)
_said = {}  # the same keys -> (status note text, note key): why the kernel was chosen


# ----------------------------------------------------------------------------------------------- kernels

def addmm(w, b, a, sign):
    w.addmm_(b, a, alpha=sign)


def block_rows(width):
    import torch

    threads = min(max(1, torch.get_num_threads()), BLOCK_THREADS)
    return max(MIN_BLOCK_ROWS, BLOCK_BYTES * threads // (4 * max(1, width)))


def fp32_blocked(w, b, a, sign):
    import torch

    if w.dtype in (torch.float32, torch.float64):
        return addmm(w, b, a, sign)  # already (at least) fp32: blocks would only add roundings into the copy
    rows, width = w.shape
    step = min(rows, block_rows(width))
    # Everything allocated before the first write: a failure here leaves the weight untouched. B and A are
    # converted whole (rank-sized): three ops per block, each one of torch's parallel regions -- on a host
    # where another process holds a core, every region can wait a time slice for its descheduled thread.
    af, bf = a.float(), b.float()
    block = torch.empty((step, width), dtype=torch.float32)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        dst, acc = w.narrow(0, start, n), block[:n]
        acc.copy_(dst)
        acc.addmm_(bf.narrow(0, start, n), af, alpha=sign)
        dst.copy_(acc)  # the one rounding


KERNELS = {"addmm": addmm, "fp32": fp32_blocked}


def widened_addmm(w, b, a, sign):
    """A LoRA narrower than the weight (bf16/fp16 factors, fp32 weight): the factors widened to the weight's
    dtype (exact), then ``addmm_`` in it: one rounding, where stock rounds the product to the LoRA's dtype."""
    w.addmm_(b.to(w.dtype), a.to(w.dtype), alpha=sign)


def blocked_in(acc):
    """Row blocks accumulated in ``acc`` (a dtype at least as wide as both the weight and the LoRA), rounded
    once into the weight: e.g. an fp32 LoRA on bf16 weights, multiplied in fp32 as stock multiplies it."""

    def blocked(w, b, a, sign):
        import torch

        rows, width = w.shape
        step = min(rows, block_rows(width) * 4 // torch.empty((), dtype=acc).element_size())
        af, bf = a.to(acc), b.to(acc)  # rank-sized; allocated before the first write
        block = torch.empty((step, width), dtype=acc)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            dst, out = w.narrow(0, start, n), block[:n]
            out.copy_(dst)
            out.addmm_(bf.narrow(0, start, n), af, alpha=sign)
            dst.copy_(out)  # the one rounding

    return blocked


def extra_bytes(kernel, rows, width, rank):
    """Upper bound of the temporary memory one call of ``kernel`` allocates (bytes), for the benchmark."""
    if kernel != "fp32":
        return 0
    step = min(rows, block_rows(width))
    return 4 * (step * width + rank * width + rows * rank)


# ----------------------------------------------------------------------------------------------- choice

# Dtypes the fused path multiplies (weights and LoRA factors); anything else runs stock's code.
FLOATS = ("bfloat16", "float16", "float32", "float64")


def supported(dtype):
    return str(dtype).replace("torch.", "") in FLOATS


def kernel_for(dtype, lora_dtype=None, note=None):
    """``(name, function)`` of the kernel for weights of ``dtype`` (LoRA factors of ``lora_dtype``, default the
    same): decided once per process and dtype pair. Both must be :func:`supported`. ``note(text, key=...)``
    (the patch's ``run.note``) is told the choice and why, when it is made.

    * same dtype: ``addmm`` or ``fp32`` (see the module docstring), decided by capability and probe;
    * a LoRA narrower than the weight (bf16 factors, fp32 weight): ``addmm`` of the widened factors;
    * otherwise (an fp32 LoRA on bf16 weights, bf16 on fp16, fp64 on fp32): row blocks in the wider of the
      two dtypes (at least fp32), so the factors are multiplied in their own precision as stock multiplies
      them, and the weight is rounded once where stock rounds the product and then the sum.
    """
    if lora_dtype is not None and lora_dtype != dtype:
        key = (dtype, lora_dtype)
        got = _chosen.get(key)
        if got is None:
            with _lock:
                got = _chosen.get(key)
                if got is None:
                    got = _chosen[key] = _decide_mixed(dtype, lora_dtype)
    else:
        name = _pinned.get(dtype)
        if name is not None:
            return name, KERNELS[name]
        key = dtype
        got = _chosen.get(key)
        if got is None:
            with _lock:
                got = _chosen.get(key)
                if got is None:
                    got = _chosen[key] = _decide(dtype)
    if note is not None:  # every run is told (a new activation too); the same note again costs a dict lookup
        text, note_key = _said[key]
        note(text, key=note_key)
    return got[:2]


def pin(dtype, name):
    """Force ``name`` (or undo with None) for ``dtype`` in this process, without deciding (benchmark)."""
    if name is None:
        _pinned.pop(dtype, None)
    else:
        KERNELS[name]  # noqa: B018 - KeyError for an unknown kernel
        _pinned[dtype] = name


def chosen():
    """``{dtype: kernel name}`` decided so far in this process (``(weight dtype, LoRA dtype)`` keys for pairs)."""
    return {dt: got[0] for dt, got in _chosen.items()}


def forget():
    """Drop every decision (the next use decides again); for tests and the benchmark."""
    with _lock:
        _chosen.clear()
        _pinned.clear()
        _said.clear()


def setting(environ=os.environ):
    """``OMNI_PATCHES_LORA_CPU_FUSED_KERNEL`` as one of :data:`CHOICES` (invalid: a warning, once; auto)."""
    raw = environ.get(ENV)
    value = (raw or "auto").strip().lower()
    if value in CHOICES:
        return value
    from .. import log

    log.once(30, (PATCH_ID, "kernel-setting", raw), "%s=%r is not one of %s; using auto", ENV, raw,
             "|".join(CHOICES))
    return "auto"


def short(dtype):
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


def _decide(dtype):
    import torch

    name = short(dtype)
    forced = setting()
    if dtype not in (torch.bfloat16, torch.float16):
        kernel, why = "addmm", f"{name} weights: addmm_ rounds once in their own precision"
    elif forced != "auto":
        kernel, why = forced, f"{ENV}={os.environ.get(ENV)}"
    else:
        native, why = capability(name)
        try:
            t = probe(dtype)
            if native is None or (native and _by_probe(native, t) == "fp32"):
                # Leaving addmm_ (or deciding alone) takes a second probe; the best of both counts: a
                # stalled round only ever makes a kernel look slower.
                again = probe(dtype)
                t = {k: min(t[k], again[k]) for k in t}
        except Exception as exc:  # the capability alone decides
            kernel = "addmm" if native else "fp32"
            why += f"; probe failed ({type(exc).__name__}: {exc})"
        else:
            kernel = _by_probe(native, t)
            why += f"; probe {t['addmm'] * 1e3:.2f} ms addmm_ vs {t['fp32'] * 1e3:.2f} ms fp32 row-blocked"
            if native is False and t["addmm"] < t["fp32"]:
                why += f"; addmm_ not used: its {name} GEMM is emulated here"
    text = f"kernel {name}: {LABELS[kernel].format(dtype=name)} ({why})"
    from .. import log

    _said[dtype] = (text, f"kernel {name}")
    log.once(20, (PATCH_ID, "kernel", name), "%s: %s", PATCH_ID, text)
    return kernel, KERNELS[kernel]


def _decide_mixed(dtype, lora_dtype):
    import torch

    acc = torch.promote_types(torch.promote_types(dtype, lora_dtype), torch.float32)
    w, lora, wide = short(dtype), short(lora_dtype), short(acc)
    if acc == dtype:
        name, kernel = f"addmm_ in {w} of the widened {lora} factors", widened_addmm
        why = f"the {lora} factors widen to {w} exactly; one rounding"
    else:
        name, kernel = f"{wide} row-blocked", blocked_in(acc)
        why = f"the {lora} factors multiplied in {wide} as stock does; one rounding into {w} (stock: two)"
    text = f"{lora} LoRA on {w} weights: {name} ({why})"
    from .. import log

    _said[(dtype, lora_dtype)] = (text, f"kernel {lora}->{w}")
    log.once(20, (PATCH_ID, "kernel", lora, w), "%s: %s", PATCH_ID, text)
    return name, kernel


def _by_probe(native, t):
    """The kernel for a capability verdict (True, False or None: unknown) and probe times (see above)."""
    if native is False:
        return "fp32"
    if native:
        return "fp32" if t["fp32"] < TO_FP32 * t["addmm"] else "addmm"
    return "addmm" if t["addmm"] <= t["fp32"] else "fp32"


# ----------------------------------------------------------------------------------------------- capability

def read_cpuinfo():
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def aten_capability():
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except Exception:
        return "unknown"


def cpu_info(text=None):
    """``(arch, model, flags)`` from /proc/cpuinfo: arch "x86" (a ``flags`` line), "arm" (``Features``) or ""."""
    text = read_cpuinfo() if text is None else text
    arch, model, flags = "", "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not arch:
            arch, flags = "x86", set(value.split())
        elif key == "Features" and not arch:
            arch, flags = "arm", set(value.split())
        elif key in ("model name", "Model name", "Hardware") and not model:
            model = value.strip()
    return arch, model, flags


def onednn_cap(environ=os.environ):
    """``(variable, value)`` of a oneDNN ISA cap in the environment, or None."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        raw = environ.get(var)
        if raw and raw.strip().lower() not in ("all", "default"):
            return var, raw.strip()
    return None


def _onednn_allows(cap, needed):
    value = _ONEDNN_ALIASES.get(cap.lower(), cap.lower())
    if value not in _ONEDNN_ISAS:
        return True  # a name we do not know: let the probe tell
    return _ONEDNN_ISAS.index(value) >= _ONEDNN_ISAS.index(needed)


def mkldnn_enabled():
    try:
        import torch

        return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    except Exception:
        return False


def capability(name):
    """``(native, why)``: does this CPU multiply ``name`` ("bf16"/"fp16") natively, as torch will use it?
    ``native`` is None where /proc/cpuinfo says nothing (the probe decides)."""
    arch, _, flags = cpu_info()
    aten = aten_capability()
    if arch == "x86":
        have = [f for f in _X86_FLAGS[name] if f in flags]
        if not have:
            return False, f"no native {name}: no {'/'.join(_X86_FLAGS[name])} in cpuinfo; ATen {aten}"
        cap = onednn_cap()
        if cap is not None and not _onednn_allows(cap[1], _ONEDNN_NEEDS[name]):
            return False, f"no native {name}: {'/'.join(have)}, but oneDNN capped to {cap[1]} by {cap[0]}"
        if not mkldnn_enabled():
            return False, f"no native {name}: {'/'.join(have)}, but torch's oneDNN is unavailable or off"
        return True, f"native {name}: {'/'.join(have)}; ATen {aten}"
    if arch == "arm":
        sve = "sve" if "sve" in flags or aten.upper().startswith("SVE") else "no sve"
        have = [f for f in _ARM_FLAGS[name] if f in flags]
        if not have:
            return False, f"no native {name}: no {'/'.join(_ARM_FLAGS[name])} in Features ({sve}); ATen {aten}"
        return True, f"native {name}: {'/'.join(have)} ({sve}); ATen {aten}"
    return None, f"{name} capability unknown (no cpuinfo flags); ATen {aten}"


def probe(dtype):
    """``{"addmm": s, "fp32": s}``: best time of each kernel on :data:`PROBE_SHAPE`, interleaved."""
    import torch

    rows, width, rank = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(rows, width, generator=g) * 0.02).to(dtype)
    b = (torch.randn(rows, rank, generator=g) * 0.05).to(dtype)
    a = (torch.randn(rank, width, generator=g) * 0.05).to(dtype)
    best = {}
    with torch.no_grad():
        for name, kernel in KERNELS.items():  # first use: oneDNN / BLAS set themselves up (ms), untimed
            kernel(w[:16, :64], b[:16], a[:, :64], 1)
        for i in range(1 + PROBE_ROUNDS):
            for name in (("addmm", "fp32") if i % 2 else ("fp32", "addmm")):
                t0 = time.perf_counter()
                KERNELS[name](w, b, a, 1 if i % 2 else -1)  # alternate signs: w stays near its start
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            slow, fast = max(best.values()), min(best.values())
            if i == 0 and slow > DECISIVE * fast and slow > DECISIVE_S:
                break  # one of them is an order of magnitude slower: no need to repeat it
    return best
