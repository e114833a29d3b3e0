"""The benchmarks keep running (smoke: `bench/run --quick`); their numbers are read by people, not asserted."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_run_quick_prints_the_summary_table():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run"), "--quick"], capture_output=True, text=True,
                          timeout=900, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout[proc.stdout.index("===== summary"):].splitlines()
    rows = [ln for ln in summary if ln.startswith("| ") and not ln.startswith("| measure")]
    assert len(rows) == 10 and all(ln.count("|") == 4 for ln in rows), summary
