"""The serving tier's ``Server``: a start-up that exits before healthy is started again once unless its first error is
the shim's, and every failure names the log's first error (the root cause vLLM's last line points "above" to).

Real processes: a stand-in ``vllm`` executable (the only stand-in: a real server needs a stack) that fails or serves
``/health`` on its ``--port`` as told by the test, with a real Python traceback in its log.
"""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from support import serving

FAKE_VLLM = textwrap.dedent('''\
    #!{python}
    import http.server, pathlib, sys
    runs = pathlib.Path({runs!r})
    plan = {plan!r}
    n = len(runs.read_text().splitlines()) if runs.exists() else 0
    with runs.open("a") as fh:
        fh.write("run\\n")
    what = plan[min(n, len(plan) - 1)]
    print("INFO starting", flush=True)

    def stage_init():
        if what == "flaky":
            raise OSError("[Errno 98] Address already in use")
        if what == "shim":
            exec(compile("raise TimeoutError('stage init timed out')", "/x/omni_patches/patches/p.py", "exec"))

    if what == "child":  # serves, with a child process of its own (its pid in <runs>.child)
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pathlib.Path({runs!r} + ".child").write_text(str(child.pid))
    elif what != "serve":
        try:
            stage_init()
        except Exception:
            import traceback
            traceback.print_exc(file=sys.stdout)
        print("RuntimeError: Orchestrator initialization failed. See root cause above.", flush=True)
        sys.exit(1)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    port = int(sys.argv[sys.argv.index("--port") + 1])
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
''')


@pytest.fixture
def server(tmp_path, mocker):
    """A ``Server`` whose ``vllm`` is the stand-in above; ``plan``: what each run does, the last one repeated."""
    made = []

    def make(*plan):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        vllm = bin_dir / "vllm"
        vllm.write_text(FAKE_VLLM.format(python=sys.executable, runs=str(tmp_path / "runs"), plan=list(plan)))
        vllm.chmod(0o755)
        mocker.patch.object(serving, "serving_python", return_value=bin_dir / "python")
        mocker.patch.object(serving, "server_path", return_value="")
        s = serving.Server("0.28.0", "model", shim=False, name="probe", workdir=tmp_path / "work")
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop(grace=5)


def runs(tmp_path):
    return len((tmp_path / "runs").read_text().splitlines())


def test_first_error_is_the_first_traceback_up_to_its_exception():
    log = "\n".join([
        "INFO up",
        "(StageDiffusionProc pid=7) Traceback (most recent call last):",
        '(StageDiffusionProc pid=7)   File "/x/worker.py", line 3, in init',
        "(StageDiffusionProc pid=7)     except RuntimeError:",
        "(StageDiffusionProc pid=7) OSError: [Errno 98] Address already in use",
        "(APIServer pid=5) Traceback (most recent call last):",
        "(APIServer pid=5) RuntimeError: see root cause above",
    ])
    cause = serving.first_error(log)
    assert cause.splitlines()[0].endswith("Traceback (most recent call last):")
    assert cause.splitlines()[-1].endswith("OSError: [Errno 98] Address already in use")
    assert "APIServer" not in cause
    assert serving.first_error("INFO a\nERROR 12-07 [core.py:1] worker died\nINFO b") == \
        "ERROR 12-07 [core.py:1] worker died"
    assert serving.first_error("INFO all fine") == "<no error in the log>"


def test_a_start_that_failed_outside_the_shim_is_started_again_once(server, tmp_path):
    s = server("flaky", "serve")
    s.start()
    with pytest.warns(RuntimeWarning, match="started again once") as warned:
        s.wait_healthy(60)
    assert runs(tmp_path) == 2
    assert "Address already in use" in str(warned[0].message)
    [failed] = s.failed_starts
    assert failed["returncode"] == 1 and failed["cause"].endswith("OSError: [Errno 98] Address already in use")
    assert "Address already in use" in (tmp_path / "work" / "server.failed-start-1.log").read_text()
    assert s.healthy()


def test_a_start_that_failed_in_the_shim_fails_at_once_naming_its_root_cause(server, tmp_path):
    s = server("shim", "serve")
    s.start()
    with pytest.raises(serving.ServerFailed) as failed:
        s.wait_healthy(60)
    assert runs(tmp_path) == 1 and not s.failed_starts
    message = str(failed.value)
    assert message.rstrip().endswith("TimeoutError: stage init timed out")
    assert "omni_patches/patches/p.py" in message.rsplit("--- the first error in", 1)[1]


def test_a_start_that_fails_twice_fails_naming_its_root_cause(server, tmp_path):
    s = server("flaky")
    s.start()
    with pytest.warns(RuntimeWarning), pytest.raises(serving.ServerFailed) as failed:
        s.wait_healthy(60)
    assert runs(tmp_path) == 2 and len(s.failed_starts) == 1
    assert str(failed.value).rstrip().endswith("OSError: [Errno 98] Address already in use")


def test_no_restart_when_asked_for_none(server, tmp_path):
    s = server("flaky", "serve")
    s.start()
    with pytest.raises(serving.ServerFailed):
        s.wait_healthy(60, restart_once=False)
    assert runs(tmp_path) == 1


def test_run_default_report_of_a_failed_start_names_its_cause(server, tmp_path, monkeypatch):
    """``examples/run_default.py --report``: a server that fails to start still leaves its report (exit code 1, the
    failure with the log's first error, the stop), and the example's exit code is the report's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "run_default.py"
    monkeypatch.setattr(sys, "path", list(sys.path))  # the example puts tests/ and the checkout in front
    spec = importlib.util.spec_from_file_location("run_default_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    s = server("shim", "serve")
    report = tmp_path / "out" / "report.json"
    rc = example.serve_one(s, lambda: b"never asked", tmp_path / "x.png", "an image", 0.0, healthy_timeout=60,
                           report=report)
    facts = json.loads(report.read_text())
    assert rc == facts["returncode"] == 1
    assert facts["error"].rstrip().endswith("TimeoutError: stage init timed out")
    assert facts["log"] == str(s.log_path) and "seconds" in facts["stopped"]
    assert "image_s" not in facts and not (tmp_path / "x.png").exists()


def test_stop_never_signals_nor_counts_a_pid_that_now_names_another_process(server, tmp_path, mocker):
    """A process the server had, ended since: its pid may name another test's process by the time the server stops
    (pid_max 32,768: the suite wraps it within minutes). ``stop`` knows its processes by pid and start time."""
    import os
    import signal
    import time

    s = server("child")
    s.start()
    s.wait_healthy(60)
    deadline = time.monotonic() + 30
    while not (tmp_path / "runs.child").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int((tmp_path / "runs.child").read_text())
    assert child in s.processes()  # seen
    os.kill(child, signal.SIGKILL)  # it ends (a zombie of the server, not reaped) ...
    real = serving.proc_stat

    def reused(pid):  # ... and its pid is another session's running process now
        found = real(pid)
        if pid == child:
            return 1, 1, 1, "S", (found[4] if found else 0) + 1
        return found

    mocker.patch.object(serving, "proc_stat", side_effect=reused)
    kill = mocker.spy(os, "kill")
    stopped = s.stop(grace=5)
    assert child not in stopped["remaining"] and child not in stopped["killed"], stopped
    assert all(c.args[0] != child for c in kill.call_args_list), kill.call_args_list
    assert stopped["remaining"] == []
