#!/usr/bin/env python
"""LoRA fusion through the REAL vllm-omni 0.28.0 ``loader.py``: stock CPU vs lora-cpu-fused-delta (and, with
``--device``, stock vs lora-accel-delta's accelerator path).

Layer set: Wan2.2-shaped transformer blocks (omni's naming: stacked ``attn1.to_qkv`` with the q/k/v
mapping, ``attn1.to_out``, cross-attention ``attn2.to_q/to_k/to_v/to_out``, ``ffn.net_0`` / ``ffn.net_2``
with Wan's 13824/5120 ffn ratio), scaled to fit: ``--hidden`` (default 5120, Wan2.2-14B's width, so the
square projections are the real 5120x5120) and ``--blocks`` (default 1 instead of 40), bf16 weights and a
rank-64 bf16 LoRA covering every projection (no bias deltas: they are negligible). ~0.7 GB at the defaults.

All paths run in ONE process, interleaved per repetition (median reported): the loader is imported
stock, its classmethods and ``_prepare_lora_delta`` are captured, then the shim is activated, which patches
the already-imported module; the bench swaps the stock objects back in for the stock rows.

Columns: ``GFLOP/s`` counts the useful LoRA work ``2*m*r*n`` per (shard of a) projection; ``bare B @ A`` is
``torch.matmul(B, A)`` alone on the same shapes, in the same run (a lower bound on what stock must do).

``--device npu:0`` / ``cuda:0``: the loader's ``get_local_device()`` (sandbox stub) answers that device.
Bytes host<->device come from the simulated npu's counters when it is used (this CPU-only machine: the
``npu`` there is tests/support/fake_npu.py, whose "device" matmul runs on the CPU -- it proves the code
path and the bytes, NOT the speed), else they are computed from the tensor sizes moved.

    python bench/lora_fusion.py                 # full run (~30 s here)
    python bench/lora_fusion.py --quick         # CI smoke (hidden 1024, 2 repetitions)
    python bench/lora_fusion.py --device npu:0  # accelerator path (simulated here)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.28.0"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions (CI smoke)")
    p.add_argument("--hidden", type=int, default=None, help="model width (default 5120; --quick: 1024)")
    p.add_argument("--blocks", type=int, default=1)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; --quick: 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default=None, help="accelerator for lora-accel-delta, e.g. npu:0 or cuda:0")
    p.add_argument("--json", action="store_true", help="also print the raw numbers as one JSON line")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.hidden = a.hidden or (1024 if a.quick else 5120)
    a.reps = a.reps or (2 if a.quick else 5)
    return a


def main(argv=None):
    args = parse(argv)
    if args.child:
        return child(args)
    sys.path.insert(0, str(ROOT / "tests"))
    from support.omni_loader import sandbox_env  # builds (once) the real-loader sandbox

    env = sandbox_env(VERSION, local_device="cpu")  # device_rows() switches the stub to --device
    env = {k: v for k, v in env.items() if not k.startswith("OMNI_PATCHES")}
    env.update(OMNI_PATCHES="1", OMNI_PATCHES_LORA_CPU_FUSED_DELTA="1", OMNI_PATCHES_LOG_LEVEL="WARNING")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *(argv if argv is not None else sys.argv[1:])]
    return subprocess.run(cmd, env=env, cwd=str(ROOT)).returncode


# ---------------------------------------------------------------------------------------------- child

def child(args):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import vllm_omni.diffusion.lora.loader as L  # stock, before activation

    mixin = L.LoraLoaderMixin
    names = ("load_lora_into_module", "unload_module_lora")
    stock = {n: mixin.__dict__[n] for n in names}, L._prepare_lora_delta

    import omni_patches

    omni_patches.activate()  # the target is already imported: patched now
    status = {s.id: s.state for s in omni_patches.status()}
    assert status["lora-cpu-fused-delta"] == "applied", status
    patched = {n: mixin.__dict__[n] for n in names}, L._prepare_lora_delta

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

    H, F, R, dt = args.hidden, round(args.hidden * 13824 / 5120), args.rank, torch.bfloat16
    model, sd, shapes = build(torch, H, F, R, args.blocks, dt)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flops = sum(2 * m * R * n for m, n in shapes)

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    A = [(sd[k.replace("lora_A", "lora_B")], sd[k]) for k in sd if k.endswith("lora_A.weight")]

    def bare():
        for b, a in A:
            torch.matmul(b, a)

    load = lambda: mixin.load_lora_into_module(sd, model)  # noqa: E731
    unload = lambda: mixin.unload_module_lora(sd, model)  # noqa: E731
    rows = {"bare": [], "stock": [], "fused": []}
    probe = first_layer_error(torch, model, sd, stock, patched, use, mixin)
    for rep in range(args.reps + 1):  # first round: warm-up (page faults, oneDNN kernel selection)
        got = {"bare": (timed(bare), 0.0)}
        for name, objs in (("stock", stock), ("fused", patched)):
            use(objs)
            got[name] = (timed(load), timed(unload))
        if rep:
            for k, v in got.items():
                rows[k].append(v)
    use(patched)
    med = {k: tuple(sorted(x[i] for x in v)[len(v) // 2] for i in (0, 1)) for k, v in rows.items()}

    out = {"hidden": H, "ffn": F, "rank": R, "blocks": args.blocks, "threads": torch.get_num_threads(),
           "weight_gib": weight_bytes / 2**30, "projections": len(shapes), "gflop": flops / 1e9,
           "median_s": med, "error_first_layer": probe, "torch": torch.__version__}
    print(f"layer set: {args.blocks} Wan2.2-shaped block(s), hidden {H}, ffn {F}, {len(shapes)} LoRA'd matrices "
          f"(stacked qkv counted per shard), rank {R}, bf16, {weight_bytes / 2**30:.2f} GiB of weights; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; real vllm-omni {VERSION} loader.py")
    print(f"{'path':<28}{'load ms':>10}{'unload ms':>11}{'GFLOP/s':>10}{'time/stock':>12}{'GFLOP/s/bare':>14}")
    for label, key in (("bare B @ A (same shapes)", "bare"), (f"stock {VERSION} CPU", "stock"),
                       ("lora-cpu-fused-delta", "fused")):
        ld, ul = med[key]
        cols = f"{label:<28}{ld * 1e3:>10.1f}" + (f"{ul * 1e3:>11.1f}" if key != "bare" else f"{'-':>11}")
        cols += f"{flops / ld / 1e9:>10.1f}"
        cols += f"{ld / med['stock'][0]:>12.3f}" if key != "bare" else f"{'':>12}"
        cols += f"{med['bare'][0] / ld:>14.2f}" if key != "bare" else f"{'':>14}"
        print(cols)
    r_time = med["fused"][0] / med["stock"][0]
    r_unload = med["fused"][1] / med["stock"][1]
    r_flops = med["bare"][0] / med["fused"][0]
    print(f"fused/stock time: load {r_time:.3f}, unload {r_unload:.3f} (goal <= 0.35); "
          f"fused GFLOP/s vs bare B @ A: {r_flops:.2f}x (goal >= 1.0)")
    print(f"max |error| vs float64 on {probe['layer']}: stock {probe['stock']:.3g}, fused {probe['fused']:.3g}")
    if args.quick:
        print("(--quick: a smoke run; at these shapes per-call overhead dominates, the goals apply to the default run)")
    out.update(ratio_time_load=r_time, ratio_time_unload=r_unload, ratio_gflops_vs_bare=r_flops)

    if args.device:
        out["device"] = device_rows(torch, args, mixin, sd, model, stock, use, simulated, weight_bytes)
    if args.json:
        print("JSON " + json.dumps(out))
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


def first_layer_error(torch, model, sd, stock, patched, use, mixin):
    """Max |W' - (W + B@A)| against float64 on the first stacked projection, stock vs fused (load only)."""
    name = "transformer.blocks.0.attn1.to_qkv.weight"
    p = dict(model.named_parameters("transformer"))[name]
    w0 = p.detach().clone()
    parts = [sd[f"transformer.blocks.0.attn1.{s}.lora_B.weight"].double() @
             sd[f"transformer.blocks.0.attn1.{s}.lora_A.weight"].double() for s in ("to_q", "to_k", "to_v")]
    ref = w0.double() + torch.cat(parts)
    out = {"layer": name}
    for key, objs in (("stock", stock), ("fused", patched)):
        use(objs)
        mixin.load_lora_into_module(sd, model)
        out[key] = (p.detach().double() - ref).abs().max().item()
        mixin.unload_module_lora(sd, model)
        with torch.no_grad():
            p.copy_(w0)  # unload rounding must not leak into the next path's error
    use(patched)
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
