"""lora-cpu-fused-delta's kernels (omni_patches/patches/_lora_cpu_kernels.py): which one a CPU gets, and that
every one of them is exact, restores on unload and allocates no weight-sized temporary.

* Kernel choice: capability parsing (cpuinfo text, oneDNN ISA cap, torch's capability) with the reader and
  the probe mocked; the env override; once per process and dtype; the real probe on this CPU.
* Exactness, unload restoration and op traces through the REAL vllm-omni 0.28.0 and 0.30.0 ``loader.py``
  (sandbox, tests/support/omni_loader.py): stock vs each kernel vs the automatic choice, bf16/fp16/fp32.
* Memory: peak RSS of one accumulate in a fresh interpreter, stock vs the kernels.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from omni_patches.patches import _lora_cpu_kernels as K
from support.omni_loader import run_sandboxed

ROOT = Path(__file__).resolve().parents[3]

AMD_EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f " \
           "avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 avx512vbmi\n"
XEON_CLX = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8260\nflags\t\t: fpu sse2 avx2 avx512f avx512bw " \
           "avx512vl avx512dq avx512_vnni\n"
XEON_SPR = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx2 avx512f avx512bw " \
           "avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"
GRAVITON2 = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp " \
            "asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU part\t: 0xd0c\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid " \
            "asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs " \
            "paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\n"


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No decision, pin, oneDNN cap or override leaks into or out of a test."""
    for var in (K.ENV, "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    K.forget()
    yield
    K.forget()


@pytest.fixture
def cpu(mocker):
    """Pretend to be another CPU: ``cpu(cpuinfo_text, aten="AVX512")``."""
    mocker.patch.object(K, "mkldnn_enabled", return_value=True)

    def use(text, aten="AVX512"):
        mocker.patch.object(K, "read_cpuinfo", return_value=text)
        mocker.patch("torch.backends.cpu.get_cpu_capability", return_value=aten)

    return use


# ------------------------------------------------------------------------------------------ capability

@pytest.mark.parametrize("text,bf16,fp16", [
    (AMD_EPYC, True, False), (XEON_CLX, False, False), (XEON_SPR, True, True),
    (GRAVITON2, False, True), (GRAVITON3, True, True), ("", None, None),  # None: unknown, the probe decides
])
def test_capability_from_cpuinfo(cpu, text, bf16, fp16):
    cpu(text)
    assert K.capability("bf16")[0] is bf16, K.capability("bf16")
    assert K.capability("fp16")[0] is fp16, K.capability("fp16")


def test_capability_reasons_name_what_was_found(cpu):
    cpu(AMD_EPYC)
    assert K.capability("bf16") == (True, "native bf16: avx512_bf16; ATen AVX512")
    assert K.capability("fp16")[1] == "no native fp16: no avx512_fp16/amx_fp16 in cpuinfo; ATen AVX512"
    cpu(GRAVITON3, aten="SVE256")
    assert K.capability("bf16") == (True, "native bf16: bf16 (sve); ATen SVE256")
    cpu(GRAVITON2, aten="DEFAULT")
    assert K.capability("bf16")[1] == "no native bf16: no bf16 in Features (no sve); ATen DEFAULT"
    assert K.cpu_info(XEON_SPR)[:2] == ("x86", "Intel(R) Xeon(R) Platinum 8480+")


@pytest.mark.parametrize("var,cap,bf16,fp16", [
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE", False, False),
    ("ONEDNN_MAX_CPU_ISA", "avx2", False, False),
    ("DNNL_MAX_CPU_ISA", "AVX512_CORE_VNNI", False, False),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", True, False),
    ("ONEDNN_MAX_CPU_ISA", "AVX10_1_512", True, True),  # alias of avx512_core_fp16
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", True, True),
    ("ONEDNN_MAX_CPU_ISA", "ALL", True, True),
    ("ONEDNN_MAX_CPU_ISA", "SOMETHING_NEW", True, True),  # unknown name: the flags (and the probe) decide
])
def test_a_onednn_isa_cap_takes_native_units_away(cpu, monkeypatch, var, cap, bf16, fp16):
    cpu(XEON_SPR)
    monkeypatch.setenv(var, cap)
    assert K.capability("bf16")[0] is bf16
    assert K.capability("fp16")[0] is fp16
    if not bf16:
        assert K.capability("bf16")[1] == f"no native bf16: avx512_bf16/amx_bf16, but oneDNN capped to {cap} by {var}"


def test_without_onednn_nothing_is_native(cpu, mocker):
    cpu(XEON_SPR)
    mocker.patch.object(K, "mkldnn_enabled", return_value=False)
    assert K.capability("bf16") == (False, "no native bf16: avx512_bf16/amx_bf16, but torch's oneDNN is "
                                           "unavailable or off")


# ------------------------------------------------------------------------------------------ the choice

def probe_says(mocker, addmm_ms, fp32_ms):
    return mocker.patch.object(K, "probe", return_value={"addmm": addmm_ms / 1e3, "fp32": fp32_ms / 1e3})


@pytest.mark.parametrize("text,addmm_ms,fp32_ms,want,probes", [
    (AMD_EPYC, 0.11, 0.44, "addmm", 1),  # native: the probe confirms (measured on this machine kind)
    (AMD_EPYC, 1.00, 0.70, "fp32", 2),  # native flags, yet fp32 clearly faster (twice): the probe wins
    (AMD_EPYC, 1.00, 0.90, "addmm", 1),  # within the margin: the capability decides
    (XEON_CLX, 0.45, 0.39, "fp32", 1),  # emulated: as fast as fp32 at probe size (measured, oneDNN capped)
    (XEON_CLX, 0.20, 0.60, "fp32", 1),  # emulated and faster here: never (weight-sized scratch, see module)
    ("", 0.20, 0.60, "addmm", 2),  # unknown CPU: the faster of two probes
    ("", 0.60, 0.20, "fp32", 2),
])
def test_probe_confirms_or_overrules_the_capability(cpu, mocker, text, addmm_ms, fp32_ms, want, probes):
    cpu(text)
    probe = probe_says(mocker, addmm_ms, fp32_ms)
    note = mocker.Mock(name="run.note")
    name, fn = K.kernel_for(torch.bfloat16, note=note)
    assert (name, fn) == (want, K.KERNELS[want])
    assert probe.call_args_list == [mocker.call(torch.bfloat16)] * probes
    (text_,), kw = note.call_args
    assert kw == {"key": "kernel bf16"}
    label = "addmm_ in bf16" if want == "addmm" else "fp32 row-blocked"
    assert text_.startswith(f"kernel bf16: {label} (")
    assert f"probe {addmm_ms:.2f} ms addmm_ vs {fp32_ms:.2f} ms fp32 row-blocked" in text_
    assert ("addmm_ not used: its bf16 GEMM is emulated here" in text_) is (text == XEON_CLX and addmm_ms < fp32_ms)


def test_a_stalled_probe_round_does_not_take_addmm_away(cpu, mocker):
    # A descheduled thread stalls the one parallel region of addmm_ in the first probe: the second decides.
    cpu(AMD_EPYC)
    probe = mocker.patch.object(K, "probe", side_effect=[{"addmm": 5e-3, "fp32": 0.44e-3},
                                                         {"addmm": 0.11e-3, "fp32": 0.45e-3}])
    note = mocker.Mock(name="run.note")
    assert K.kernel_for(torch.bfloat16, note=note)[0] == "addmm"
    assert probe.call_count == 2
    assert note.call_args[0][0].endswith("probe 0.11 ms addmm_ vs 0.44 ms fp32 row-blocked)")  # best of both


def test_note_text_on_a_cpu_without_native_bf16(cpu, mocker):
    cpu(XEON_CLX)
    probe_says(mocker, 0.45, 0.39)
    note = mocker.Mock(name="run.note")
    K.kernel_for(torch.bfloat16, note=note)
    assert note.call_args[0][0] == ("kernel bf16: fp32 row-blocked (no native bf16: no avx512_bf16/amx_bf16 in "
                                    "cpuinfo; ATen AVX512; probe 0.45 ms addmm_ vs 0.39 ms fp32 row-blocked)")


def test_decided_once_per_process_and_dtype(cpu, mocker):
    cpu(AMD_EPYC)
    probe = probe_says(mocker, 0.11, 0.44)
    for _ in range(3):
        assert K.kernel_for(torch.bfloat16)[0] == "addmm"
    assert probe.call_count == 1
    probe.return_value = {"addmm": 30e-3, "fp32": 0.5e-3}  # fp16 without avx512_fp16 (measured here)
    for _ in range(3):
        assert K.kernel_for(torch.float16)[0] == "fp32"
    assert probe.call_count == 2
    assert K.chosen() == {torch.bfloat16: "addmm", torch.float16: "fp32"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp32_and_wider_weights_use_addmm_without_a_probe(cpu, mocker, monkeypatch, dtype):
    cpu(XEON_CLX)
    probe = probe_says(mocker, 1.0, 0.1)
    monkeypatch.setenv(K.ENV, "fp32")
    assert K.kernel_for(dtype)[0] == "addmm"
    probe.assert_not_called()


def test_a_failing_probe_leaves_the_capability_to_decide(cpu, mocker):
    cpu(XEON_CLX)
    mocker.patch.object(K, "probe", side_effect=RuntimeError("no time"))
    note = mocker.Mock(name="run.note")
    assert K.kernel_for(torch.bfloat16, note=note)[0] == "fp32"
    assert note.call_args[0][0].endswith("; probe failed (RuntimeError: no time))")


@pytest.mark.parametrize("value,want", [("addmm", "addmm"), ("fp32", "fp32"), (" FP32 ", "fp32")])
def test_env_override_skips_capability_and_probe(cpu, mocker, monkeypatch, value, want):
    cpu(AMD_EPYC if want == "fp32" else XEON_CLX)  # the opposite of what auto would pick
    probe = probe_says(mocker, 1.0, 1.0)
    note = mocker.Mock(name="run.note")
    monkeypatch.setenv(K.ENV, value)
    assert K.kernel_for(torch.bfloat16, note=note)[0] == want
    assert K.kernel_for(torch.float16, note=note)[0] == want
    probe.assert_not_called()
    assert note.call_args[0][0].endswith(f"({K.ENV}={value})")


def test_invalid_override_warns_once_and_means_auto(cpu, mocker, monkeypatch, logs):
    cpu(AMD_EPYC)
    probe = probe_says(mocker, 0.11, 0.44)
    monkeypatch.setenv(K.ENV, "fastest-please")
    assert K.kernel_for(torch.bfloat16)[0] == "addmm"
    assert K.kernel_for(torch.float16)[0] == "fp32"  # no avx512_fp16
    assert probe.call_count == 2  # auto: once per dtype
    warned = [m for m in logs.messages(logging.WARNING) if K.ENV in m]
    assert warned == [f"{K.ENV}='fastest-please' is not one of auto|addmm|fp32; using auto"]


def test_pin_wins_without_deciding(mocker):
    probe = mocker.patch.object(K, "probe")
    K.pin(torch.bfloat16, "fp32")
    assert K.kernel_for(torch.bfloat16) == ("fp32", K.fp32_blocked)
    K.pin(torch.bfloat16, None)
    probe.assert_not_called()
    with pytest.raises(KeyError):
        K.pin(torch.bfloat16, "fast")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_probe_on_this_cpu(dtype):
    # Measured, not asserted: both kernels ran and took some time; what they took is the note's business.
    t = K.probe(dtype)
    assert set(t) == {"addmm", "fp32"} and all(v > 0 for v in t.values()), t


# ------------------------------------------------------------------------------------------ kernels directly

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,width,rank", [(70, 64, 8), (48, 300, 16)])
def test_kernels_round_once_across_ragged_row_blocks(mocker, dtype, rows, width, rank):
    mocker.patch.object(K, "block_rows", return_value=20)  # 20-row blocks: 70 = 3*20 + 10, 48 = 2*20 + 8
    g = torch.Generator().manual_seed(rows)
    w0 = (torch.randn(rows, width, generator=g) * 0.05).to(dtype)
    b = (torch.randn(rows, rank, generator=g) * 0.2).to(dtype)
    a = (torch.randn(rank, width, generator=g) * 0.2).to(dtype)
    exact = w0.double() + b.double() @ a.double()
    stock = w0 + (b @ a)  # two roundings
    for name, kernel in K.KERNELS.items():
        w = w0.clone()
        kernel(w, b, a, 1)
        if dtype != torch.float32:  # one rounding: the float64 result rounded once (but for a rare near-tie)
            assert (w != exact.to(dtype)).float().mean().item() < 0.01, (name, dtype)
        assert (w.double() - exact).abs().max() <= (stock.double() - exact).abs().max(), (name, dtype)
        loaded = w.clone()
        kernel(w, b, a, -1)
        assert_within_one_rounding(w0, w, loaded, name)


@pytest.mark.parametrize("threads,width,rows", [(1, 5120, 128), (2, 5120, 256), (8, 5120, 512), (1, 13824, 47),
                                                (1, 1024, 640), (1, 10**6, 16)])
def test_row_blocks_are_about_l2_sized_per_thread(mocker, threads, width, rows):
    mocker.patch("torch.get_num_threads", return_value=threads)
    assert K.block_rows(width) == rows


def assert_within_one_rounding(original, restored, loaded, label):
    """Unload restores every element to within one unit in the last place of the loaded value."""
    up = torch.nextafter(loaded.abs(), torch.tensor(float("inf"), dtype=loaded.dtype))
    ulp = up.double() - loaded.abs().double()
    off = (restored.double() - original.double()).abs()
    assert (off <= ulp).all(), f"{label}: {(off > ulp).sum().item()} elements off by more than one rounding"


# ------------------------------------------------------------------------------------------ memory

MEMORY = r'''
import ctypes, json, re, sys
import torch
from omni_patches.patches import _lora_cpu_kernels as K

torch.set_num_threads(1)
# Freed blocks must leave RSS (glibc keeps them otherwise): every allocation of 64 KiB or more is its own mmap.
libc = ctypes.CDLL(None)
libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
dtype = getattr(torch, sys.argv[1])
rows, width, rank = 1536, 2048, 64


def rss(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def peak(fn):
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = rss("VmRSS")
    fn()
    return rss("VmHWM") - before


g = torch.Generator().manual_seed(0)
w = (torch.randn(rows, width, generator=g) * 0.05).to(dtype)
b = (torch.randn(rows, rank, generator=g) * 0.1).to(dtype)
a = (torch.randn(rank, width, generator=g) * 0.1).to(dtype)
name, _ = K.kernel_for(dtype)  # the automatic choice (probe included) happens before measuring
out = {"auto": name, "weight": w.numel() * w.element_size(), "bound": K.extra_bytes("fp32", rows, width, rank)}
for _ in range(2):  # warm-up: libraries set themselves up on first use
    w.add_(b @ a); w.sub_(b @ a)
    for kernel in K.KERNELS.values():
        kernel(w, b, a, 1); kernel(w, b, a, -1)
with torch.no_grad():
    out["stock"] = peak(lambda: w.add_(b @ a))
    for k, kernel in K.KERNELS.items():
        out[k] = peak(lambda: kernel(w, b, a, 1))
print("RESULT " + json.dumps(out))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS through /proc/self/clear_refs")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_no_weight_sized_temporary(dtype):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(MEMORY), dtype], capture_output=True, text=True,
                          timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    slack = 256 * 1024  # page granularity and small bookkeeping allocations
    # stock's B @ A: a weight-sized temporary. RSS can also drop by a few hundred KiB while it runs (pages the
    # allocator or the kernel release), so the lower bound allows 1/8 of the weight -- still far above the bound.
    assert res["stock"] >= res["weight"] * 7 // 8, res
    assert res["stock"] > res["bound"] + slack, res
    assert res["fp32"] <= res["bound"] + slack, res  # one fp32 row block + fp32 A and B (rank-sized)
    assert res["bound"] < res["weight"], res
    assert res[res["auto"]] <= res["bound"] + slack, res  # what a user gets (emulated addmm_ would not pass)


# ------------------------------------------------------------------------------------------ the real loader

DRIVER = r'''
import json, os
import torch

import vllm_omni.diffusion.lora.loader as L  # stock, captured before activation
import omni_patches
from omni_patches.patches import _lora_cpu_kernels as K
from support.omni_loader import expected_deltas, make_lora_state_dict, tiny_transformer
from torch.utils._python_dispatch import TorchDispatchMode

cfg = json.loads(os.environ["LORA_TEST_CFG"])
names = ("load_lora_into_module", "unload_module_lora")
mixin = L.LoraLoaderMixin
stock = {n: mixin.__dict__[n] for n in names}, L._prepare_lora_delta
from omni_patches import engine
assert not engine.is_active()  # started with OMNI_PATCHES unset: the loader above is stock
os.environ["OMNI_PATCHES"] = "1"
omni_patches.activate()
patched = {n: mixin.__dict__[n] for n in names}, L._prepare_lora_delta
assert patched[1] is not stock[1], "the shim did not patch the imported loader"
if "auto" in cfg["paths"]:  # decided at first use, as in production; here before any op trace below
    for name in cfg["dtypes"]:
        K.kernel_for(getattr(torch, name))
K.block_rows = lambda width: 24  # several (ragged) row blocks per shard: 24 + 24 + 16 rows


def use(objs):
    for n, v in objs[0].items():
        setattr(mixin, n, v)
    L._prepare_lora_delta = objs[1]


H, R = cfg["hidden"], cfg["rank"]


class Ops(TorchDispatchMode):
    """aten ops by name and the dtype of their first tensor argument, e.g. ``addmm_:torch.bfloat16``."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        key = f"{func.overloadpacket.__name__}:{first.dtype if first is not None else '-'}"
        self.ops[key] = self.ops.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


res = {"paths": {}}
for dtype_name in cfg["dtypes"]:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = tiny_transformer(H).to(dtype)
    lora = cfg.get("lora", {}).get(dtype_name)  # a LoRA of another dtype than the weights (default: the same)
    sd = make_lora_state_dict(model, rank=R, bias=True, seed=1, scale=0.3, dtype=getattr(torch, lora) if lora else None)
    ref = expected_deltas(sd, model)
    params = dict(model.named_parameters("transformer"))
    before = {k: v.detach().clone() for k, v in params.items()}
    for path in cfg["paths"]:
        if path not in ("auto", "stock"):
            K.pin(dtype, path)
        use(stock if path == "stock" else patched)
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(before[k])
        mode = Ops()
        with mode:
            mixin.load_lora_into_module(sd, model)
        loaded = {k: v.detach().clone() for k, v in params.items()}
        sq = n = mx = 0.0
        for k in ref:
            d = loaded[k].double() - (before[k].double() + ref[k])
            sq += d.pow(2).sum().item(); n += d.numel(); mx = max(mx, d.abs().max().item())
        unload_mode = Ops()
        with unload_mode:
            mixin.unload_module_lora(sd, model)
        off_by_more = 0
        restored_exactly = total = 0
        for k in ref:
            up = torch.nextafter(loaded[k].abs(), torch.tensor(float("inf"), dtype=dtype))
            ulp = up.double() - loaded[k].abs().double()
            off = (params[k].detach().double() - before[k].double()).abs()
            off_by_more += (off > ulp).sum().item()
            restored_exactly += (off == 0).sum().item(); total += off.numel()
        res["paths"][f"{dtype_name}/{path}"] = {
            "load_max": mx, "load_rms": (sq / n) ** 0.5, "unload_off_by_more": off_by_more,
            "unload_exact": restored_exactly / total, "load_ops": mode.ops, "unload_ops": unload_mode.ops}
        K.pin(dtype, None)
res["pairs"] = sum(k.endswith(".lora_A.weight") for k in sd)
res["chosen"] = {str(k): v for k, v in K.chosen().items()}
res["status"] = {s.id: [s.state, s.reason] for s in omni_patches.status()}
print("RESULT " + json.dumps(res))
'''

DTYPES = ["bfloat16", "float16", "float32"]


def drive(version, *, env=None, **cfg):
    cfg = {"hidden": 64, "rank": 8, "dtypes": DTYPES, "paths": ["auto", "stock", "addmm", "fp32"], **cfg}
    # OMNI_PATCHES is set by the driver after it captured the stock loader (at start-up, the .pth would patch it).
    extra = {"OMNI_PATCHES_LORA_CPU_FUSED_DELTA": "1", "OMNI_PATCHES_LORA_ACCEL_DELTA": "0",
             "LORA_TEST_CFG": json.dumps(cfg), **(env or {})}
    proc = run_sandboxed(version, DRIVER, extra=extra, local_device="cpu", timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), proc.stderr


@pytest.fixture(scope="module", params=["0.28.0", "0.30.0"])
def loader_run(request):
    return request.param, *drive(request.param)


def test_every_kernel_is_at_least_as_exact_as_stock_through_the_real_loader(loader_run):
    version, res, _ = loader_run
    for dtype in DTYPES:
        stock = res["paths"][f"{dtype}/stock"]
        for kernel in ("auto", "addmm", "fp32"):
            got = res["paths"][f"{dtype}/{kernel}"]
            assert got["load_max"] <= stock["load_max"] and got["load_rms"] <= stock["load_rms"], \
                (version, dtype, kernel, got, stock)
            if dtype != "float32":  # stock rounds twice (B @ A, then the add): visibly worse
                assert got["load_rms"] < stock["load_rms"], (version, dtype, kernel)


def test_unload_restores_each_weight_within_one_rounding(loader_run):
    version, res, _ = loader_run
    for key, got in res["paths"].items():  # stock too: a sign or shard mix-up would be off by 2 * delta
        assert got["unload_off_by_more"] == 0, (version, key, got)


def test_the_kernel_that_ran_is_the_one_chosen(loader_run):
    version, res, _ = loader_run
    shards = res["pairs"]
    for dtype in ("bfloat16", "float16"):
        for phase in ("load_ops", "unload_ops"):
            fused = res["paths"][f"{dtype}/addmm"][phase]
            assert fused.get(f"addmm_:torch.{dtype}") == shards and "mm:torch.%s" % dtype not in fused, fused
            blocked = res["paths"][f"{dtype}/fp32"][phase]
            assert f"addmm_:torch.{dtype}" not in blocked and f"mm:torch.{dtype}" not in blocked, blocked
            # 64-row shards in 24-row blocks: 3 blocks each (qkv shards, to_out), ffn_up 128 rows: 6.
            assert blocked.get("addmm_:torch.float32") == 2 * (4 * 3 + 6), blocked
            stock = res["paths"][f"{dtype}/stock"][phase]
            assert stock.get(f"mm:torch.{dtype}") == shards and "addmm_:torch.%s" % dtype not in stock, stock
    assert res["chosen"].keys() == {"torch.bfloat16", "torch.float16", "torch.float32"}
    assert res["chosen"]["torch.float32"] == "addmm"


def test_status_shows_the_choice_and_the_log_says_it_once(loader_run):
    version, res, stderr = loader_run
    state, reason = res["status"]["lora-cpu-fused-delta"]
    assert state == "applied", (state, reason)
    for dtype, short in (("bfloat16", "bf16"), ("float16", "fp16")):
        label = "addmm_ in " + short if res["chosen"][f"torch.{dtype}"] == "addmm" else "fp32 row-blocked"
        assert f"kernel {short}: {label} (" in reason and " ms fp32 row-blocked)" in reason, reason
        assert sum(f"lora-cpu-fused-delta: kernel {short}: " in ln for ln in stderr.splitlines()) == 1, stderr
    assert "kernel fp32: addmm_ in fp32 (fp32 weights: addmm_ rounds once in their own precision)" in reason


# weights -> LoRA: an fp32 LoRA on bf16 weights (the loader's `.to(param.dtype)` rounds stock's fp32 product before
# the add rounds again), a bf16 LoRA on fp16 weights (stock: bf16 product, then fp16), a bf16 LoRA on fp32 weights
# (stock: a bf16 product added in fp32).
MIXED = {"bfloat16": "float32", "float16": "bfloat16", "float32": "bfloat16"}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@pytest.mark.parametrize("version", ["0.28.0", "0.32.0rc1"])
def test_mixed_dtype_loras_are_fused_rounding_once(version):
    res, _ = drive(version, dtypes=list(MIXED), paths=["auto", "stock"], lora=MIXED)
    reason = res["status"]["lora-cpu-fused-delta"][1]
    shards = res["pairs"]
    for w, lora in MIXED.items():
        fused, stock = res["paths"][f"{w}/auto"], res["paths"][f"{w}/stock"]
        # Stock rounds the product to a narrower dtype than the kernels keep it in: strictly less exact.
        assert fused["load_max"] <= stock["load_max"] and fused["load_rms"] < stock["load_rms"], (w, fused, stock)
        assert fused["unload_off_by_more"] == 0, (w, fused)
        for phase in ("load_ops", "unload_ops"):
            ops = fused[phase]
            assert not any(k.startswith("mm:") for k in ops), (w, phase, ops)  # no B @ A materialised
            assert stock[phase].get(f"mm:torch.{lora}") == shards, (w, phase, stock[phase])
            # fp32 weights: one addmm_ per shard; narrower ones: fp32 row blocks (3 per 64-row shard, 6 for ffn_up)
            want = shards if w == "float32" else 2 * (4 * 3 + 6)
            assert ops.get("addmm_:torch.float32") == want, (w, phase, ops)
        label = "addmm_ in fp32 of the widened bf16 factors" if w == "float32" else "fp32 row-blocked"
        assert f"{SHORT[lora]} LoRA on {SHORT[w]} weights: {label} (" in reason, reason
        assert f"{SHORT[lora]} LoRA on {SHORT[w]} weights: {label} x" in reason, reason  # the paths note
    assert "ran the original code" not in reason, reason


@pytest.mark.parametrize("value,want", [("fp32", "fp32"), ("addmm", "addmm")])
def test_env_override_through_the_real_loader(value, want):
    res, stderr = drive("0.28.0", env={K.ENV: value}, dtypes=["bfloat16"], paths=["auto"])
    assert res["chosen"] == {"torch.bfloat16": want}
    ops = res["paths"]["bfloat16/auto"]["load_ops"]
    assert ("addmm_:torch.bfloat16" in ops) is (want == "addmm"), ops
    assert f"kernel bf16: {'addmm_ in bf16' if want == 'addmm' else 'fp32 row-blocked'} ({K.ENV}={value})" \
        in res["status"]["lora-cpu-fused-delta"][1]


def test_invalid_override_through_the_real_loader_warns_and_probes():
    res, stderr = drive("0.28.0", env={K.ENV: "turbo"}, dtypes=["bfloat16"], paths=["auto"])
    assert f"{K.ENV}='turbo' is not one of auto|addmm|fp32; using auto" in stderr
    assert stderr.count("is not one of auto|addmm|fp32") == 1
    assert " ms fp32 row-blocked)" in res["status"]["lora-cpu-fused-delta"][1]  # the probe ran


@pytest.mark.skipif(not K.capability("bf16")[0] or K.cpu_info()[0] != "x86",
                    reason="needs an x86 CPU with native bf16 to take away")
def test_auto_picks_fp32_where_onednn_is_capped_below_native_bf16():
    # A CPU without native bf16, made of this one: oneDNN capped to the ISA of a Xeon without avx512_bf16.
    # Stock's and addmm_'s bf16 GEMMs are emulated there (bench/lora_fusion.py's second pass measures it).
    res, _ = drive("0.28.0", env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, dtypes=["bfloat16"], paths=["auto", "stock"])
    assert res["chosen"] == {"torch.bfloat16": "fp32"}
    reason = res["status"]["lora-cpu-fused-delta"][1]
    # The CPU's own bf16 features are named: avx512_bf16, or avx512_bf16/amx_bf16 on a CPU with AMX.
    assert re.search(r"kernel bf16: fp32 row-blocked \(no native bf16: avx512_bf16(/amx_bf16)?, but oneDNN capped to "
                     r"AVX512_CORE by ONEDNN_MAX_CPU_ISA; probe ", reason), reason
    auto, stock = res["paths"]["bfloat16/auto"], res["paths"]["bfloat16/stock"]
    assert auto["load_rms"] < stock["load_rms"] and auto["unload_off_by_more"] == 0


def test_no_threads_of_our_own():
    # torch's intra-op pool does the parallel work (torch.get_num_threads()); nothing here adds threads
    # around it or changes its setting.
    import threading

    before = (threading.active_count(), torch.get_num_threads())
    K.probe(torch.bfloat16)
    w, b, a = torch.zeros(64, 128, dtype=torch.bfloat16), torch.ones(64, 8, dtype=torch.bfloat16), \
        torch.ones(8, 128, dtype=torch.bfloat16)
    for kernel in K.KERNELS.values():
        kernel(w, b, a, 1)
    assert (threading.active_count(), torch.get_num_threads()) == before


def test_modules_import_without_torch():
    # omni-patches audit imports every patch module in a plain venv: torch only at first use.
    code = ("import sys; sys.modules['torch'] = None\n"
            "import omni_patches.patches.lora_cpu_fused_delta, omni_patches.patches._lora_cpu_kernels as K\n"
            "assert K.setting() == 'auto' and K.cpu_info('flags : avx2')[0] == 'x86'\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != K.ENV}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stderr
