#!/usr/bin/env python
"""LoRA fusion through the REAL vllm-omni 0.28.0 ``loader.py``: stock CPU vs lora-cpu-fused-delta with each of
its kernels (and, with ``--device``, stock vs lora-accel-delta's accelerator path).

Layer set: Wan2.2-shaped transformer blocks (omni's naming: stacked ``attn1.to_qkv`` with the q/k/v
mapping, ``attn1.to_out``, cross-attention ``attn2.to_q/to_k/to_v/to_out``, ``ffn.net_0`` / ``ffn.net_2``
with Wan's 13824/5120 ffn ratio), scaled to fit: ``--hidden`` (default 5120, Wan2.2-14B's width, so the
square projections are the real 5120x5120) and ``--blocks`` (default 1 instead of 40), bf16 weights and a
rank-64 bf16 LoRA covering every projection (no bias deltas: they are negligible). ~0.7 GB at the defaults.

Each pass runs in ONE process: the loader is imported stock (the child starts with OMNI_PATCHES unset, so
the .pth cannot patch it first), its classmethods and ``_prepare_lora_delta`` are captured, then the shim
is activated, which patches the already-imported module; the bench swaps the stock objects back in for
the stock rows. The automatic kernel choice is made first (as at a user's first load: capability +
probe) and printed; then stock, ``addmm_`` and ``fp32`` row-blocked (both pinned in turn) run
interleaved, in a rotating order, for ``--reps`` rounds after a warm-up round; medians are reported.

Two passes by default: this CPU as it is, then -- where this CPU multiplies bf16 natively (x86
avx512_bf16) -- the same in a child whose oneDNN is capped below native bf16 (``ONEDNN_MAX_CPU_ISA``,
default ``AVX512_CORE``: the ISA of an Intel Xeon without avx512_bf16), so a CPU without native bf16 is
measured too. The "GEMM check" line of each pass (bare ``B @ A`` in bf16 vs fp32 on the same shapes)
shows whether bf16 really ran natively there.

Columns: ``GFLOP/s`` counts the useful LoRA work ``2*m*r*n`` per (shard of a) projection; ``error`` is
the max |W - float64 reference| after a load (on 256 rows of each q/k/v shard of the first block);
``restore`` the max |W after load+unload - W before| in units of the last place of the loaded weight;
``peak MiB`` the peak extra memory of one load or unload (= the largest per-layer temporary: each layer
frees its own before the next), measured in a separate process started with glibc's mmap threshold fixed
at 64 KiB (``MALLOC_MMAP_THRESHOLD_``: every block that size or larger is returned to the system when
freed, so RSS is live memory): peak RSS (VmHWM after resetting it through /proc/self/clear_refs) minus
RSS before; after one warm-up round, the smaller of two rounds. ``bound`` is the
fp32 kernel's own ceiling (one fp32 row block + fp32 copies of ``A`` and ``B``, rank-sized).

``--device npu:0`` / ``cuda:0``: the loader's ``get_local_device()`` (sandbox stub) answers that device.
Bytes host<->device come from the simulated npu's counters when it is used (this CPU-only machine: the
``npu`` there is tests/support/fake_npu.py, whose "device" matmul runs on the CPU -- it proves the code
path and the bytes, NOT the speed), else they are computed from the tensor sizes moved.

    python bench/lora_fusion.py                    # full run, both passes
    python bench/lora_fusion.py --quick            # CI smoke (hidden 512, 2 repetitions)
    python bench/lora_fusion.py --threads 1        # torch threads (default: torch's)
    python bench/lora_fusion.py --isa-cap none     # this CPU only
    python bench/lora_fusion.py --device npu:0     # accelerator path (simulated here)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.28.0"
KERNELS = ("addmm", "fp32")
GOAL = 0.40


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions (CI smoke)")
    p.add_argument("--hidden", type=int, default=None, help="model width (default 5120; --quick: 512)")
    p.add_argument("--blocks", type=int, default=1)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; --quick: 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--isa-cap", default="AVX512_CORE",
                   help="oneDNN ISA of the second pass (a CPU without native bf16); 'none': no second pass")
    p.add_argument("--device", default=None, help="accelerator for lora-accel-delta, e.g. npu:0 or cuda:0")
    p.add_argument("--json", action="store_true", help="also print the raw numbers as one JSON line")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--label", default="", help=argparse.SUPPRESS)
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.hidden = a.hidden or (512 if a.quick else 5120)
    a.reps = a.reps or (2 if a.quick else 5)
    return a


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.child:
        return child(args)
    sys.path.insert(0, str(ROOT / "tests"))
    from support.omni_loader import sandbox_env  # builds (once) the real-loader sandbox

    from omni_patches.patches import _lora_cpu_kernels as K

    env = sandbox_env(VERSION, local_device="cpu")  # device_rows() switches the stub to --device
    # OMNI_PATCHES stays unset: the child imports the stock loader first, then activates (see the docstring).
    env = {k: v for k, v in env.items() if not k.startswith("OMNI_PATCHES") and k not in ("ONEDNN_MAX_CPU_ISA",
                                                                                            "DNNL_MAX_CPU_ISA")}
    env.update(OMNI_PATCHES_LORA_CPU_FUSED_DELTA="1", OMNI_PATCHES_LOG_LEVEL="WARNING")
    if os.environ.get("OMNI_PATCHES_STATE_DIR"):
        env["OMNI_PATCHES_STATE_DIR"] = os.environ["OMNI_PATCHES_STATE_DIR"]
    rest = [a for a in argv if a != "--json"]
    passes = [("this CPU", env)]
    arch, model, _ = K.cpu_info()
    native, _ = K.capability("bf16")
    if args.isa_cap.lower() == "none" or args.device:
        pass
    elif arch == "x86" and native:
        cap = args.isa_cap.upper()
        passes.append((f"{model or 'this CPU'} with oneDNN capped to {cap}: no native bf16",
                       {**env, "ONEDNN_MAX_CPU_ISA": cap}))
    else:
        print("(second pass skipped: this CPU has no native bf16 to take away; the pass above is that case)")
    results = []
    for i, (label, penv) in enumerate(passes):
        print(f"\n===== pass {i + 1}: {label}", flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--label", label, *rest]
        # Memory first, in its own process: glibc's mmap threshold fixed from the start (64 KiB), so no
        # block of 64 KiB or more is ever kept by the allocator after it is freed (RSS = live memory).
        peaks = run_child(cmd + ["--memory-only"], {**penv, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}, echo=False)
        got = peaks and run_child(cmd, {**penv, "BENCH_PEAKS": json.dumps(peaks["peaks"])}, echo=True)
        if not got:
            return 1
        results.append(got)
    out = dict(results[0])
    if len(results) > 1:
        out["capped"] = results[1]
    print("\n===== summary (time/stock of a load, median; chosen = what auto picks on that CPU)")
    for r in results:
        k = r["kernels"]
        print(f"{r['label']}: chosen {r['chosen']} {r['ratio_time_load']:.3f} (unload {r['ratio_time_unload']:.3f}, "
              f"best-of-{r['reps']} load {k[r['chosen']]['best_ratio_load']:.3f}); "
              f"addmm_ {k['addmm']['ratio_load']:.3f}, fp32 row-blocked {k['fp32']['ratio_load']:.3f} "
              f"(goal <= {GOAL:.2f}); peak extra MiB: stock {r['stock']['peak_mib']:.1f}, "
              f"addmm_ {k['addmm']['peak_mib']:.1f}, fp32 {k['fp32']['peak_mib']:.1f} (bound {r['bound_mib']:.1f})")
    if args.json:
        print("JSON " + json.dumps(out))
    return 0


def run_child(cmd, env, echo):
    """Run one child; its CHILD-JSON line (None if it failed), other output echoed (or dropped)."""
    proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, text=True)
    got = None
    for line in proc.stdout:
        if line.startswith("CHILD-JSON "):
            got = json.loads(line[len("CHILD-JSON "):])
        elif echo:
            sys.stdout.write(line)
            sys.stdout.flush()
    return None if proc.wait() else got


# ---------------------------------------------------------------------------------------------- child

def child(args):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import vllm_omni.diffusion.lora.loader as L  # stock: the shim is not active yet

    import omni_patches
    from omni_patches import engine
    from omni_patches.patches import _lora_cpu_kernels as K

    assert not engine.is_active(), "started with the shim active: the stock rows would be patched"
    mixin = L.LoraLoaderMixin
    names = ("load_lora_into_module", "unload_module_lora")
    stock = {n: mixin.__dict__[n] for n in names}, L._prepare_lora_delta
    os.environ["OMNI_PATCHES"] = "1"
    omni_patches.activate()  # the target is already imported: patched now
    status = {s.id: s.state for s in omni_patches.status()}
    assert status["lora-cpu-fused-delta"] == "applied", status
    patched = {n: mixin.__dict__[n] for n in names}, L._prepare_lora_delta
    assert patched[1] is not stock[1]

    def use(objs):
        for n, v in objs[0].items():
            setattr(mixin, n, v)
        L._prepare_lora_delta = objs[1]

    simulated = False
    if args.device:
        if args.device.startswith("npu") and not hasattr(torch, "npu"):  # no torch_npu: simulate it
            sys.path.insert(0, str(ROOT))
            from tests.support import fake_npu

            fake_npu.install()
            simulated = True

    dt = torch.bfloat16
    t0 = time.perf_counter()
    chosen, _ = K.kernel_for(dt)  # what a user gets at the first load (capability + probe)
    decide_ms = (time.perf_counter() - t0) * 1e3
    reason = next(s.reason for s in omni_patches.status() if s.id == "lora-cpu-fused-delta")
    note = reason[reason.index("kernel bf16"):] if "kernel bf16" in reason else reason  # the run's kernel note

    H, F, R = args.hidden, round(args.hidden * 13824 / 5120), args.rank
    model, sd, shapes = build(torch, H, F, R, args.blocks, dt)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flops = sum(2 * m * R * n for m, n in shapes)
    pairs = [(sd[k.replace("lora_A", "lora_B")], sd[k]) for k in sd if k.endswith("lora_A.weight")]
    pairs32 = [(b.float(), a.float()) for b, a in pairs]

    arch, cpu_model, _ = K.cpu_info()
    cap = K.onednn_cap()
    print(f"CPU: {cpu_model or 'unknown'} ({arch or '?'}), ATen capability {K.aten_capability()}, oneDNN cap "
          f"{'%s=%s' % cap if cap else 'none'}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"bf16 capability: {K.capability('bf16')[1]}")
    print(f"auto choice ({decide_ms:.1f} ms, once per process): {note}")
    print(f"layer set: {args.blocks} Wan2.2-shaped block(s), hidden {H}, ffn {F}, {len(shapes)} LoRA'd matrices "
          f"(stacked qkv counted per shard), rank {R}, bf16, {weight_bytes / 2**30:.2f} GiB of weights; "
          f"real vllm-omni {VERSION} loader.py")

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def bare(ps):
        def run():
            for b, a in ps:
                torch.matmul(b, a)
        return run

    def fused(kernel):
        def run(fn):
            K.pin(dt, kernel)
            try:
                return fn()
            finally:
                K.pin(dt, None)
        return run

    load = lambda: mixin.load_lora_into_module(sd, model)  # noqa: E731
    unload = lambda: mixin.unload_module_lora(sd, model)  # noqa: E731
    paths = {"stock": (stock, lambda fn: fn())}
    for k in KERNELS:
        paths[k] = (patched, fused(k))
    if args.memory_only:
        peaks = memory_rows(paths, use, load, unload)
        print("CHILD-JSON " + json.dumps({"peaks": peaks}), flush=True)
        return 0
    peaks = json.loads(os.environ.get("BENCH_PEAKS") or "{}")
    peaks = {k: peaks.get(k, float("nan")) for k in paths}
    errors = error_rows(torch, model, sd, paths, use, load, unload)
    rows = {k: [] for k in ("bare", "bare32", *paths)}
    order = list(paths)
    for rep in range(args.reps + 1):  # first round: warm-up (page faults, oneDNN kernel selection)
        got = {"bare": (timed(bare(pairs)), 0.0), "bare32": (timed(bare(pairs32)), 0.0)}
        for name in order[rep % len(order):] + order[:rep % len(order)]:  # rotate: no path always first
            objs, wrap = paths[name]
            use(objs)
            got[name] = (wrap(lambda: timed(load)), wrap(lambda: timed(unload)))
        if rep:
            for k, v in got.items():
                rows[k].append(v)
    use(patched)
    med = {k: tuple(sorted(x[i] for x in v)[len(v) // 2] for i in (0, 1)) for k, v in rows.items()}
    bound = max(K.extra_bytes("fp32", m, n, R) for m, n in shapes)

    print(f"GEMM check (bare B @ A, same shapes): bf16 {med['bare'][0] * 1e3:.1f} ms, fp32 "
          f"{med['bare32'][0] * 1e3:.1f} ms -> bf16 is {med['bare32'][0] / med['bare'][0]:.2f}x as fast as fp32 "
          f"({'native' if med['bare'][0] * 1.5 < med['bare32'][0] else 'not clearly faster than fp32: emulated'} "
          f"here)")
    labels = {"stock": f"stock {VERSION} CPU", "addmm": "fused: addmm_ in bf16", "fp32": "fused: fp32 row-blocked"}
    print(f"{'path':<32}{'load ms':>9}{'unload ms':>10}{'GFLOP/s':>9}{'time/stock':>11}{'error':>10}"
          f"{'restore':>9}{'peak MiB':>10}")
    print(f"{'bare B @ A in bf16 (same shapes)':<32}{med['bare'][0] * 1e3:>9.1f}{'-':>10}"
          f"{flops / med['bare'][0] / 1e9:>9.1f}")
    out_kernels = {}
    for name in paths:
        ld, ul = med[name]
        label = labels[name] + (" (auto)" if name == chosen else "")
        e = errors[name]
        print(f"{label:<32}{ld * 1e3:>9.1f}{ul * 1e3:>10.1f}{flops / ld / 1e9:>9.1f}{ld / med['stock'][0]:>11.3f}"
              f"{e['max']:>10.2g}{e['restore_ulp']:>8.1f}u{peaks[name] / 2**20:>10.1f}")
        if name != "stock":
            out_kernels[name] = {"load_s": ld, "unload_s": ul, "ratio_load": ld / med["stock"][0],
                                 "best_ratio_load": min(x[0] for x in rows[name]) / min(x[0] for x in rows["stock"]),
                                 "ratio_unload": ul / med["stock"][1], "error": e, "peak_mib": peaks[name] / 2**20}
    print(f"(bound of the fp32 kernel's temporaries, largest layer: {bound / 2**20:.1f} MiB; stock's largest "
          f"delta: {max(m * n for m, n in shapes) * 2 / 2**20:.1f} MiB per shard)")
    r_load, r_unload = out_kernels[chosen]["ratio_load"], out_kernels[chosen]["ratio_unload"]
    r_flops = med["bare"][0] / med[chosen][0]
    print(f"chosen kernel ({chosen}): fused/stock time load {r_load:.3f}, unload {r_unload:.3f} (goal <= {GOAL:.2f}); "
          f"fused GFLOP/s vs bare bf16 B @ A: {r_flops:.2f}x")
    if args.quick:
        print("(--quick: a smoke run; at these shapes per-call overhead dominates, the goals apply to the default run)")

    out = {"label": args.label, "cpu": cpu_model, "arch": arch, "onednn_cap": cap, "aten": K.aten_capability(),
           "bf16_capability": K.capability("bf16")[1], "chosen": chosen, "note": note, "decide_ms": decide_ms,
           "hidden": H, "ffn": F, "rank": R, "blocks": args.blocks, "reps": args.reps,
           "threads": torch.get_num_threads(),
           "weight_gib": weight_bytes / 2**30, "projections": len(shapes), "gflop": flops / 1e9,
           "median_s": med, "torch": torch.__version__, "kernels": out_kernels,
           "stock": {"load_s": med["stock"][0], "unload_s": med["stock"][1], "error": errors["stock"],
                     "peak_mib": peaks["stock"] / 2**20},
           "bound_mib": bound / 2**20, "ratio_time_load": r_load, "ratio_time_unload": r_unload,
           "ratio_gflops_vs_bare": r_flops}
    if args.device:
        out["device"] = device_rows(torch, args, mixin, sd, model, stock, use, simulated, weight_bytes)
    print("CHILD-JSON " + json.dumps(out), flush=True)
    return 0


def build(torch, H, F, R, blocks, dt):
    """Omni-named Wan2.2 blocks (only the LoRA'd projections) and a rank-R LoRA state dict for all of them."""
    nn = torch.nn

    class Attn(nn.Module):
        def __init__(self, fused):
            super().__init__()
            if fused:
                self.to_qkv = nn.Linear(H, 3 * H, bias=False, dtype=dt)
            else:
                self.to_q, self.to_k, self.to_v = (nn.Linear(H, H, bias=False, dtype=dt) for _ in range(3))
            self.to_out = nn.Linear(H, H, bias=False, dtype=dt)

    class FFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.net_0 = nn.Linear(H, F, bias=False, dtype=dt)
            self.net_2 = nn.Linear(F, H, bias=False, dtype=dt)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn1, self.attn2, self.ffn = Attn(True), Attn(False), FFN()

    class Model(nn.Module):
        stacked_params_mapping = [(".attn1.to_qkv", ".attn1.to_q", "q"), (".attn1.to_qkv", ".attn1.to_k", "k"),
                                  (".attn1.to_qkv", ".attn1.to_v", "v")]

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    torch.manual_seed(0)
    with torch.no_grad():
        model = Model()
        for p in model.parameters():
            p.normal_(0, 0.02)
    g = torch.Generator().manual_seed(1)
    sd, shapes = {}, []
    for name, p in model.named_parameters("transformer"):
        base = name[: -len(".weight")]
        keys = [base.replace(".to_qkv", s) for s in (".to_q", ".to_k", ".to_v")] if ".to_qkv" in base else [base]
        rows = p.shape[0] // len(keys)
        for k in keys:
            sd[f"{k}.lora_A.weight"] = (torch.randn(R, p.shape[1], generator=g) * 0.05).to(dt)
            sd[f"{k}.lora_B.weight"] = (torch.randn(rows, R, generator=g) * 0.05).to(dt)
            shapes.append((rows, p.shape[1]))
    return model, sd, shapes


def error_rows(torch, model, sd, paths, use, load, unload, sample=256):
    """Per path: max/rms |W' - (W + B@A)| against float64 after a load, and the unload's distance from the
    original in units of the last place of the loaded weight; on ``sample`` rows of each q/k/v shard."""
    name = "transformer.blocks.0.attn1.to_qkv.weight"
    p = dict(model.named_parameters("transformer"))[name]
    shard = p.shape[0] // 3
    rows = torch.cat([torch.arange(s * shard, s * shard + min(sample, shard)) for s in range(3)])
    w0 = p.detach().clone()
    parts = [sd[f"transformer.blocks.0.attn1.{s}.lora_B.weight"][:sample].double() @
             sd[f"transformer.blocks.0.attn1.{s}.lora_A.weight"].double() for s in ("to_q", "to_k", "to_v")]
    ref = w0[rows].double() + torch.cat(parts)
    out = {}
    for key, (objs, wrap) in paths.items():
        use(objs)
        wrap(load)
        loaded = p.detach()[rows].clone()
        d = loaded.double() - ref
        wrap(unload)
        up = torch.nextafter(loaded.abs(), torch.tensor(float("inf"), dtype=loaded.dtype))
        ulp = up.double() - loaded.abs().double()
        restore = ((p.detach()[rows].double() - w0[rows].double()).abs() / ulp).max().item()
        out[key] = {"max": d.abs().max().item(), "rms": d.pow(2).mean().sqrt().item(), "restore_ulp": restore}
        with torch.no_grad():
            p.copy_(w0)  # this path's rounding must not leak into the next one's
    return out


def memory_rows(paths, use, load, unload):
    """Peak extra RSS of one load (and of its unload, the larger is kept) per path; see the docstring."""
    import ctypes
    import gc
    import re

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed (no longer adaptive), so frees return memory
        open("/proc/self/clear_refs", "w").close()
    except (OSError, AttributeError):
        return {k: float("nan") for k in paths}

    def rss(key):
        with open("/proc/self/status") as f:
            return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) * 1024

    def peak(fn):
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = rss("VmRSS")
        fn()
        return rss("VmHWM") - before

    out = {}
    for name, (objs, wrap) in paths.items():
        use(objs)
        wrap(load)  # the first call after the allocator change pays one-time costs (measured: +5 MiB)
        wrap(unload)
        # Steady state: the smaller of two measured load+unload rounds (a stray one-time cost is not per layer).
        out[name] = min(max(wrap(lambda: peak(load)), wrap(lambda: peak(unload))) for _ in range(2))
    return out


def device_rows(torch, args, mixin, sd, model, stock, use, simulated, weight_bytes):
    """Stock (CPU) vs lora-accel-delta (B @ A on the device) for the same CPU-resident weights."""
    dev = torch.device(args.device)
    import vllm_omni.diffusion.lora.loader as L

    patched = {n: mixin.__dict__[n] for n in ("load_lora_into_module", "unload_module_lora")}, L._prepare_lora_delta
    counters = None
    if simulated:
        from tests.support import fake_npu

        counters = fake_npu

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    import vllm_omni.diffusion.distributed.utils as U

    U.LOCAL_DEVICE = args.device  # the stub's get_local_device() now answers it (the CPU table ran with "cpu")
    res = {}
    for rep in range(args.reps + 1):
        for name, objs in (("stock", stock), ("accel", patched)):
            use(objs)
            if counters:
                counters.reset_counters()
            sync()
            t = time.perf_counter()
            mixin.load_lora_into_module(sd, model)
            sync()
            t_load = time.perf_counter() - t
            c = counters.counters() if counters else None
            mixin.unload_module_lora(sd, model)
            if rep:
                res.setdefault(name, []).append((t_load, c))
    use(patched)
    U.LOCAL_DEVICE = None
    lora_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"--device {dev}{' (SIMULATED: tests/support/fake_npu.py, matmul runs on the CPU; code path and bytes only)' if simulated else ''}")
    print(f"{'path':<28}{'load ms':>10}{'time/stock':>12}{'npu/dev matmuls':>17}{'H2D MiB':>10}{'D2H MiB':>10}")
    out = {}
    for name in ("stock", "accel"):
        ts = sorted(x[0] for x in res[name])
        t = ts[len(ts) // 2]
        c = res[name][0][1]
        if c is not None:
            mm, h2d, d2h, how = c["npu_matmuls"], c["h2d_bytes"], c["d2h_bytes"], "measured"
        else:  # computed: accel moves A and B up and each delta (weight-sized) back
            mm = sum(k.endswith("lora_A.weight") for k in sd) if name == "accel" else 0
            h2d, d2h, how = (lora_bytes, weight_bytes, "computed") if name == "accel" else (0, 0, "computed")
        out[name] = {"load_s": t, "matmuls": mm, "h2d": h2d, "d2h": d2h, "bytes": how}
        label = f"stock {VERSION} CPU" if name == "stock" else "lora-accel-delta"
        print(f"{label:<28}{t * 1e3:>10.1f}{t / out['stock']['load_s']:>12.3f}{mm:>17}{h2d / 2**20:>10.1f}"
              f"{d2h / 2**20:>10.1f}")
    print(f"(bytes {out['accel']['bytes']}; the probe allocation is included in the measured counters)")
    return out


if __name__ == "__main__":
    sys.exit(main())
