"""The benchmarks keep running (smoke: `bench/run --quick`); their numbers are read by people, not asserted."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_run_quick_prints_the_summary_table():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run"), "--quick"], capture_output=True, text=True,
                          timeout=900, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout[proc.stdout.index("===== summary:"):].splitlines()  # bench/run's own table
    rows = [ln for ln in summary if ln.startswith("| ") and not ln.startswith("| measure")]
    assert all(ln.count("|") == 4 for ln in rows), summary
    measures = [ln.split("|")[1].strip() for ln in rows]
    for expected in ("start-up, OMNI_PATCHES unset", "start-up, OMNI_PATCHES=1", "per call: ctx.wrap",
                     "per call: ctx.replace", "LoRA fusion: lora-cpu-fused-delta / stock 0.28.0 time (load)",
                     "LoRA fusion: lora-cpu-fused-delta / stock 0.28.0 time (unload)", "LoRA fusion: fused GFLOP/s",
                     "idle MoE-LoRA forward: unpatched", "idle MoE-LoRA forward: patched",
                     "ascend-moe-skip-idle-lora per call over bare"):
        assert sum(m.startswith(expected) for m in measures) == 1, (expected, summary)
    # one over-floor row per call path (no context / LoRA batch / idle adapter); the capped-CPU LoRA row only
    # where this CPU has native bf16 to cap
    assert sum("over a do-nothing forwarder" in m for m in measures) == 3, summary
