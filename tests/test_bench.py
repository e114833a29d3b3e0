"""The benchmarks keep running (smoke: `bench/run --quick`); their numbers are read by people, not asserted."""
import json
import re
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
    # one row per convolution shape of bench/conv_dtype.py's quick run (the two smaller ones)
    assert sum(m.startswith("bf16 Conv") and m.endswith("native / fp32-rounded time") for m in measures) == 2, summary


BURN_CODE = "import time\nt = time.process_time()\nwhile time.process_time() - t < 2.0: pass"
# A daemon as `ray start` leaves one: forked, its parent gone 3 s later (so a half-second sample sees it in the
# tree first), started from an empty environment; only then it burns 2 s of CPU and says so in a file.
DAEMON_CODE = """
import os, sys, time
if os.fork() == 0:
    os.execve(sys.executable, [sys.executable, "-c", sys.argv[2], sys.argv[1], str(os.getppid())], {})
time.sleep(3.0)
"""
DAEMON_BURN = """
import os, sys, time
while os.getppid() == int(sys.argv[2]):
    time.sleep(0.05)
t = time.process_time()
while time.process_time() - t < 2.0: pass
open(sys.argv[1], "w").close()
"""
BURN = f'''
import subprocess, sys, time

def test_burns_in_a_child():
    # 2 s of CPU in a process of its own: charged to this test by the profiler
    subprocess.run([sys.executable, "-c", {BURN_CODE!r}], check=True)

def test_a_daemon_burns_after_it_left_the_tree(tmp_path):
    done = tmp_path / "done"
    subprocess.run([sys.executable, "-c", {DAEMON_CODE!r}, str(done), {DAEMON_BURN!r}], check=True)
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert done.exists()
    time.sleep(0.2)  # its exit

def test_idle():
    pass
'''


def test_suite_cpu_charges_a_childs_cpu_to_its_test_file(tmp_path):
    """bench/suite_cpu.py: a test whose child burns 2 s of CPU is charged that (less the last half-second sample
    at most), to its own test id; so is one whose daemon burns it after leaving the tree; the idle test nothing."""
    (tmp_path / "test_burn.py").write_text(BURN)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "suite_cpu.py"), "--json", str(tmp_path / "c.json"),
                           "--", "-q", "-p", "no:cacheprovider", "test_burn.py"], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = [ln.split("|")[3].strip() for ln in proc.stdout.splitlines() if ln.startswith("| ") and ln.endswith(" |")]
    assert "test_burn.py" in files, proc.stdout
    records = json.loads((tmp_path / "c.json").read_text())
    burn = [r for r in records if r["test"] == "test_burn.py::test_burns_in_a_child"]
    assert len(burn) == 1 and burn[0]["kind"] == "python", records
    assert burn[0]["cmd"].endswith(" -c " + BURN_CODE), burn
    assert 1.4 <= burn[0]["cpu_s"] <= 3.0, burn
    assert not [r for r in records if r["test"].endswith("::test_idle")], records  # it started nothing
    # The daemon: re-parented, with no test in its environment -- still charged its 2 s, to the test it came from.
    daemon = [r for r in records if " -c " + DAEMON_BURN.rstrip() in r["cmd"] and "os.fork()" not in r["cmd"]]
    assert len(daemon) == 1, records
    assert daemon[0]["test"] == "test_burn.py::test_a_daemon_burns_after_it_left_the_tree", daemon
    assert 1.4 <= daemon[0]["cpu_s"] <= 3.0, daemon
    # The whole machine's busy time (/proc/stat) beside the charge: never less than what was charged.
    charged = float(re.search(r"charged: ([\d.]+) CPU-min", proc.stdout).group(1))
    machine = float(re.search(r"the whole machine: ([\d.]+) CPU-min busy", proc.stdout).group(1))
    assert machine >= charged - 0.1, proc.stdout
