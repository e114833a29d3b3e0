"""Start-up and per-call cost of the shim, measured side by side in one run.

    python bench/startup.py [--runs 200] [--venv DIR]

* ``python -c pass`` in a fresh venv with omni-patches installed, the .pth present vs removed (OMNI_PATCHES
  unset): the ratio must stay <= 1.02;
* the same interpreter with ``OMNI_PATCHES=1`` and no target imported vs unset: the extra ms (budget +5 ms);
* ns per call of the wrappers the engine installs (wrapt ``ctx.wrap``, plain ``ctx.replace``) vs the bare call.

Runs are interleaved (A B C A B C ...) so drift in machine load hits every variant alike; medians reported.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def build_venv(where):
    from support.venvs import make_venv, site_packages

    python = make_venv(Path(where) / "env")
    return python, site_packages(python)


def time_start(python, env, runs_out):
    t0 = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, check=True)
    runs_out.append((time.perf_counter() - t0) * 1e3)


def startup(python, site, runs):
    pth = site / "omni_patches.pth"
    off = site / "omni_patches.pth.off"
    base = {k: v for k, v in os.environ.items()
            if (not k.startswith("OMNI_PATCHES") or k == "OMNI_PATCHES_STATE_DIR") and k != "PYTHONPATH"}
    on = dict(base, OMNI_PATCHES="1")
    variants = {"no .pth": (False, base), ".pth, unset": (True, base), ".pth, OMNI_PATCHES=1": (True, on)}
    samples = {k: [] for k in variants}
    names = list(variants)
    for _ in range(5):  # warm the page cache
        subprocess.run([str(python), "-c", "pass"], env=base, check=True)
    try:
        for i in range(runs):
            # Rotated order: each variant runs first, second and third (right after a rename or not) equally
            # often, so position effects cancel out instead of landing on one variant.
            for name in names[i % 3:] + names[:i % 3]:
                with_pth, env = variants[name]
                if with_pth and off.exists():
                    off.rename(pth)
                elif not with_pth and pth.exists():
                    pth.rename(off)
                time_start(python, env, samples[name])
    finally:
        if off.exists():
            off.rename(pth)
    return {k: statistics.median(v) for k, v in samples.items()}


def pth_line_us(site_dir, n=2000):
    """What the .pth costs the interpreter directly (OMNI_PATCHES unset): ``site.addpackage`` on it -- open, read,
    compile and run the line -- in µs, min of 5 x ``n``."""
    import site

    saved, env = list(sys.path), os.environ.pop("OMNI_PATCHES", None)
    try:
        def once():
            site.addpackage(str(site_dir), "omni_patches.pth", set())
            sys.path[:] = saved
        return min(timeit.repeat(once, number=n, repeat=5)) / n * 1e6
    finally:
        if env is not None:
            os.environ["OMNI_PATCHES"] = env


def per_call(n=200_000):
    """ns per call: bare method vs the engine's two wrapping techniques, on the same tiny method."""
    from omni_patches import wrapping

    class Runner:
        def forward(self, hidden_states, router_logits, return_with_event=False):
            return hidden_states

    bare = Runner()
    globals_ = {"r": bare}
    results = {"bare call": min(timeit.repeat("r.forward(1, 2)", globals=globals_, number=n, repeat=5)) / n * 1e9}

    class Wrapped(Runner):
        pass

    wrapping.wrap(Wrapped, "forward", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs), "bench")
    globals_["w"] = Wrapped()
    results["ctx.wrap (wrapt)"] = min(timeit.repeat("w.forward(1, 2)", globals=globals_, number=n, repeat=5)) / n * 1e9

    class Replaced(Runner):
        pass

    def make(original):
        def forward(self, hidden_states, router_logits, return_with_event=False):
            return original(self, hidden_states, router_logits, return_with_event)
        return forward

    wrapping.replace(Replaced, "forward", make, "bench")
    globals_["p"] = Replaced()
    results["ctx.replace (exact signature)"] = min(
        timeit.repeat("p.forward(1, 2)", globals=globals_, number=n, repeat=5)) / n * 1e9
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--venv", help="reuse this directory for the venv (created if missing)")
    ap.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    args = ap.parse_args(argv)
    tmp = None
    if args.venv and (Path(args.venv) / "env" / "bin" / "python").exists():
        from support.venvs import site_packages

        python = Path(args.venv) / "env" / "bin" / "python"
        site = site_packages(python)
    else:
        where = args.venv or (tmp := tempfile.mkdtemp(prefix="omni-bench-"))
        python, site = build_venv(where)
    try:
        med = startup(python, site, args.runs)
        line_us = pth_line_us(site)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    calls = per_call()
    base = med["no .pth"]
    print(f"start-up of `python -c pass` ({args.runs} interleaved runs each, median, Python {sys.version.split()[0]})")
    print(f"  {'variant':28s} {'ms':>8s} {'ratio':>7s}")
    for k, v in med.items():
        print(f"  {k:28s} {v:8.2f} {v / base:7.3f}")
    print(f"  .pth unset vs no .pth:       ratio {med['.pth, unset'] / base:.3f} (budget <= 1.02)")
    print(f"  the .pth line itself, unset: {line_us:.0f} us in-process (site.addpackage: read, compile, run)")
    print(f"  OMNI_PATCHES=1 vs unset:     {med['.pth, OMNI_PATCHES=1'] - med['.pth, unset']:+.2f} ms (budget <= +5 ms)")
    print("per call (min of 5 x 200k calls)")
    bare = calls["bare call"]
    for k, v in calls.items():
        print(f"  {k:32s} {v:7.0f} ns  (+{v - bare:.0f} ns)")
    if args.json:
        import json

        print("JSON " + json.dumps({"startup_ms": med, "pth_line_us": line_us, "per_call_ns": calls}))
    return med, calls


if __name__ == "__main__":
    main()
