"""Half-precision convolutions on this CPU: why the serving tiers' CPU platform computes them in fp32.

    python bench/conv_dtype.py            # full run (~40 s on 2 cores without native bf16)
    python bench/conv_dtype.py --quick    # CI smoke (the two smaller shapes, one round each: a few seconds)

The serving tiers' tiny models decode through a VAE of ``Conv2d`` / ``Conv3d`` layers in bf16 (HunyuanImage3's VAE
under fp16 autocast). On a CPU without native bf16 (no ``avx512_bf16`` / ``amx_bf16``: oneDNN converts in software)
those convolutions are many times slower than the same ones in fp32, and the servers spent their start-up's dummy
run and every image on them. The test CPU platform (``tests/support/serving_cpu_platform.py``,
``_half_convolutions_in_fp32``) therefore runs a half-precision convolution as: inputs to fp32, the fp32
convolution, the result rounded back to the half dtype. Per shape (batch 1, 3x3 / 3x3x3 kernels, padding 1), three
forms timed interleaved (so drift in the machine's load hits them equally), median of the rounds:

  bf16 native     the layer and input in bf16: what stock PyTorch runs
  fp32            the layer and input in fp32
  fp32, rounded   the platform's form: bf16 in, fp32 compute, bf16 out

and the largest difference between the two bf16 results relative to the output's largest magnitude (both forms
round fp32-accumulated values to bf16, whose spacing is 2^-8 of a value: differences of that order are rounding).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from omni_patches.patches import _lora_cpu_kernels as K  # noqa: E402  (the CPU's bf16 capability, as lora_fusion.py)

SHAPES = {  # name -> (module class, channels, spatial size)
    "Conv2d 32ch 64x64": (torch.nn.Conv2d, 32, (64, 64)),
    "Conv3d 32ch 4x32x32": (torch.nn.Conv3d, 32, (4, 32, 32)),
    "Conv3d 16ch 4x64x64": (torch.nn.Conv3d, 16, (4, 64, 64)),
}


def fp32_rounded(conv, x):
    """The platform's form: the half input and parameters in fp32, the fp32 convolution, rounded back."""
    bias = None if conv.bias is None else conv.bias.float()
    return conv._conv_forward(x.float(), conv.weight.float(), bias).to(x.dtype)


def time_once(fn, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def bench_shape(cls, channels, size, rounds, reps):
    torch.manual_seed(0)
    conv32 = cls(channels, channels, 3, padding=1)
    conv16 = copy.deepcopy(conv32).to(torch.bfloat16)
    x32 = torch.randn(1, channels, *size)
    x16 = x32.to(torch.bfloat16)
    forms = {
        "bf16 native": lambda: conv16(x16),
        "fp32": lambda: conv32(x32),
        "fp32, rounded": lambda: fp32_rounded(conv16, x16),
    }
    with torch.no_grad():
        for fn in forms.values():  # warm-up: oneDNN picks and caches its kernels
            fn()
        times = {name: [] for name in forms}
        for _ in range(rounds):
            for name, fn in forms.items():
                times[name].append(time_once(fn, reps))
        native, rounded = conv16(x16).float(), fp32_rounded(conv16, x16).float()
    rel = ((native - rounded).abs().max() / rounded.abs().max()).item()
    ms = {name: statistics.median(v) for name, v in times.items()}
    return {"ms": ms, "native_over_rounded": ms["bf16 native"] / ms["fp32, rounded"],
            "rounded_over_fp32": ms["fp32, rounded"] / ms["fp32"], "max_rel_diff": rel}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="also print one JSON line (bench/run reads it)")
    args = ap.parse_args()
    rounds, reps = (1, 1) if args.quick else (7, 3)
    shapes = dict(list(SHAPES.items())[:2]) if args.quick else SHAPES
    native, why = K.capability("bf16")  # the patch's own answer: cpuinfo flags, oneDNN's cap, mkldnn on
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {why}; median of {rounds} rounds x {reps}")
    print(f"{'shape':<22} {'bf16 native':>12} {'fp32':>9} {'fp32, rounded':>14} {'native/rounded':>15} "
          f"{'rounded/fp32':>13} {'max rel diff':>13}")
    out = {"native_bf16": bool(native), "capability": why, "shapes": {}}
    for name, (cls, channels, size) in shapes.items():
        r = bench_shape(cls, channels, size, rounds, reps)
        out["shapes"][name] = r
        ms = r["ms"]
        print(f"{name:<22} {ms['bf16 native']:>10.2f}ms {ms['fp32']:>7.2f}ms {ms['fp32, rounded']:>12.2f}ms "
              f"{r['native_over_rounded']:>14.1f}x {r['rounded_over_fp32']:>12.2f}x {r['max_rel_diff']:>13.1e}")
    if args.json:
        print("JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
