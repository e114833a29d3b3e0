"""Real interpreters: a fresh venv with the project pip-installed, its .pth acting at start-up."""
import json
import re
import shutil
import sys
import textwrap

import pytest

from support import fakes
from support.venvs import make_venv, run, site_packages

pytestmark = pytest.mark.venv

CHILD_PROBE = '''
import multiprocessing as mp

def probe(q):
    import sys
    import fakeomni.loader
    q.put((fakeomni.loader.compute(3), "omni_patches.engine" in sys.modules))

def run(method):
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=probe, args=(q,))
    p.start()
    result = q.get(timeout=60)
    p.join(60)
    return result, p.exitcode
'''


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """One non-editable install shared by the module; fake target + fake patches live in its site-packages."""
    root = tmp_path_factory.mktemp("venv")
    python = make_venv(root / "env")
    site = site_packages(python)
    fakes.fake_omni(site, "0.28.0")
    shutil.copytree(fakes.__file__.rsplit("/support/", 1)[0] + "/fakepatches", site / "fakepatches")
    (site / "childprobe.py").write_text(CHILD_PROBE)
    registry = root / "fake.toml"
    registry.write_text(fakes.registry_text(fakes.entry()))
    boom = root / "boom.toml"
    boom.write_text(fakes.registry_text(fakes.entry("fake-boom", module="fakepatches.boom")))
    broken = root / "broken.toml"
    broken.write_text("[[patch]\n")
    return {"python": python, "site": site, "registry": str(registry), "boom": str(boom), "broken": str(broken)}


def test_installed_layout(venv):
    site = venv["site"]
    assert (site / "omni_patches.pth").is_file()
    assert (site / "omni_patches" / "patches.toml").is_file(), "the installed package must carry the registry"
    assert (site / "omni_patches.pth").read_text().count("\n") == 1


def test_unset_imports_nothing(venv):
    for value in (None, "0", "off"):
        out = run(venv["python"], "import sys; print(sorted(m for m in sys.modules if m.startswith('omni')))",
                  OMNI_PATCHES=value)
        assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_set_is_lazy_then_patches_on_import(venv):
    code = textwrap.dedent("""
        import sys
        heavy = [m for m in ("wrapt", "packaging", "importlib.metadata", "omni_patches.gates", "torch") if m in sys.modules]
        assert "omni_patches.engine" in sys.modules, "not activated"
        assert not heavy, heavy
        import fakeomni.loader
        assert "wrapt" in sys.modules
        print(fakeomni.loader.compute(3))
    """)
    out = run(venv["python"], code, OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["registry"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "6"
    assert "fake-double: applied to fakeomni.loader" in out.stderr


#: What ``OMNI_PATCHES=1`` may import at interpreter start, besides builtin modules (engine.py's start-up path).
#: ``_version``: the package's ``__version__`` in a module of its own (one line), which the process record reads
#: without importing the package's front, whose calls import the engine (tests/test_layers.py: no cycle).
START_UP_MODULES = {"omni_patches", "omni_patches._version", "omni_patches._bootstrap", "omni_patches.flags",
                    "omni_patches.engine", "omni_patches.registry"}


def test_set_imports_only_the_start_up_modules_and_builtins(venv):
    """The start-up budget (+5 ms, bench/startup.py) holds only while activation imports nothing but its own small
    modules and builtins: ``states`` alone (an enum) cost ~7 ms here when the engine imported it at start-up."""
    code = "import sys; mods = sorted(sys.modules); import json; print(json.dumps(mods))"
    off, on = (run(venv["python"], code, OMNI_PATCHES=value) for value in (None, "1"))
    assert off.returncode == 0 and on.returncode == 0, (off.stderr, on.stderr)
    added = set(json.loads(on.stdout)) - set(json.loads(off.stdout))
    assert {m for m in added if m not in sys.builtin_module_names} == START_UP_MODULES, sorted(added)


def test_python_S_disables_it(venv):
    out = run(venv["python"], "import sys; print('omni_patches' in sys.modules)", "-S", OMNI_PATCHES="1")
    assert out.stdout.strip() == "False", out


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_children_are_patched(venv, method):
    code = f"import childprobe; print(childprobe.run({method!r}))"
    out = run(venv["python"], code, OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["registry"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "((6, True), 0)"


def test_broken_registry_does_not_stop_the_interpreter(venv):
    out = run(venv["python"], "import fakeomni.loader as m; print(m.compute(3))",
              OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["broken"])
    assert out.returncode == 0 and out.stdout.strip() == "3", out
    assert "cannot read registry" in out.stderr


def test_raising_patch_does_not_stop_the_import(venv):
    out = run(venv["python"], "import fakeomni.loader as m; print(m.compute(3))",
              OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["boom"])
    assert out.returncode == 0 and out.stdout.strip() == "3", out
    assert "fake-boom: failed" in out.stderr and out.stderr.count("boom from a broken patch") >= 1


def test_strict_mode_fails_the_import(venv):
    out = run(venv["python"], "import fakeomni.loader", OMNI_PATCHES="1", OMNI_PATCHES_STRICT="1",
              OMNI_PATCHES_CONFIG=venv["boom"])
    assert out.returncode != 0 and "RuntimeError: boom from a broken patch" in out.stderr


@pytest.mark.parametrize("content,needle", [
    ("[[patch]\nid = ", "cannot read registry: TOMLDecodeError"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "cannot read registry: UnicodeDecodeError"),
    (fakes.registry_text(fakes.entry("fake-typed", default="yes")),
     "patch 'fake-typed': key 'default' must be bool"),
])
def test_strict_mode_stops_the_program_on_a_broken_registry(venv, tmp_path, content, needle):
    """The .pth cannot stop the interpreter (site prints and ignores what it raises): the first target
    import does, with one message naming the file, the entry and the problem."""
    overlay = tmp_path / "overlay.toml"
    overlay.write_bytes(content if isinstance(content, bytes) else content.encode())
    configs = f"{venv['registry']}:{overlay}"
    out = run(venv["python"], "import fakeomni.loader; print('ran')", OMNI_PATCHES="1", OMNI_PATCHES_STRICT="1",
              OMNI_PATCHES_CONFIG=configs)
    assert out.returncode == 1 and "ran" not in out.stdout, out
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("omni_patches.engine.StrictModeError: omni-patches (OMNI_PATCHES_STRICT=1): "), last
    assert str(overlay) in last and needle in last, last
    # Without strict mode the same registry leaves the program running (patched by the valid entries).
    out = run(venv["python"], "import fakeomni.loader as m; print(m.compute(3))", OMNI_PATCHES="1",
              OMNI_PATCHES_CONFIG=configs)
    assert out.returncode == 0 and out.stdout.strip() == "6", out


def test_cli_exits_quietly_into_a_closed_pipe(venv):
    import subprocess

    from support.venvs import clean_env

    exe = venv["python"].parent / "omni-patches"
    for args in (["status"], ["list"], ["status", "--json"]):
        proc = subprocess.Popen([str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=clean_env(OMNI_PATCHES_CONFIG=venv["registry"]))
        proc.stdout.close()  # the reader (`| head`) is gone before the first line
        err = proc.stderr.read().decode()
        proc.wait(60)
        assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_invalid_master_value_warns_and_stays_off(venv):
    out = run(venv["python"], "import sys, fakeomni.loader as m; print(m.compute(3), 'omni_patches.engine' in sys.modules)",
              OMNI_PATCHES="perhaps", OMNI_PATCHES_CONFIG=venv["registry"])
    assert out.stdout.strip() == "3 False", out
    assert "'perhaps'" in out.stderr


def test_cli_entry_points(venv):
    exe = venv["python"].parent / "omni-patches"
    import subprocess

    from support.venvs import clean_env

    out = subprocess.run([str(exe), "status", "--json"], capture_output=True, text=True,
                         env=clean_env(OMNI_PATCHES_CONFIG=venv["registry"]))
    assert out.returncode == 0, out.stderr
    assert '"fake-double"' in out.stdout and '"inactive"' in out.stdout  # OMNI_PATCHES unset in this shell
    out = subprocess.run([str(exe), "status", "--json"], capture_output=True, text=True,
                         env=clean_env(OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["registry"]))
    assert '"pending"' in out.stdout  # active through the .pth: the target is just not imported here
    out = subprocess.run([str(venv["python"]), "-m", "omni_patches", "doctor"], capture_output=True, text=True,
                         env=clean_env(OMNI_PATCHES_CONFIG=venv["registry"]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ready" in out.stdout


def test_audit_in_a_plain_install_needs_no_torch(venv, tmp_path):
    """A plain `pip install omni-patches` venv has no torch: audit reads the patches' checks statically."""
    import json
    import subprocess

    from support import wheels
    from support.venvs import clean_env

    wheel = wheels.download("vllm-omni", "0.28.0")
    exe = venv["python"].parent / "omni-patches"
    proc = subprocess.run([str(exe), "audit", "--json", "--wheel", str(wheel), "--cache", str(tmp_path)],
                          capture_output=True, text=True, env=clean_env())
    assert subprocess.run([str(venv["python"]), "-c", "import torch"], capture_output=True).returncode != 0
    doc = json.loads(proc.stdout)
    verdicts = {p["id"]: p for p in doc["patches"]}
    assert all(p["verdict"] != "failed" for p in verdicts.values()), verdicts
    assert verdicts["lora-accel-delta"]["verdict"] == "would apply"
    assert proc.stderr == "", proc.stderr  # no warnings of anyone's


def test_editable_install_also_activates(tmp_path):
    python = make_venv(tmp_path / "env", editable=True)
    site = site_packages(python)
    assert (site / "omni_patches.pth").is_file()
    fakes.fake_omni(site, "0.28.0")
    shutil.copytree(fakes.__file__.rsplit("/support/", 1)[0] + "/fakepatches", site / "fakepatches")
    reg = tmp_path / "fake.toml"
    reg.write_text(fakes.registry_text(fakes.entry()))
    out = run(python, "import fakeomni.loader as m; print(m.compute(3))", OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=str(reg))
    assert out.stdout.strip() == "6", out


def test_pep829_start_file_activates_once_beside_the_pth(venv):
    """Python 3.15+ calls the .start entry point instead of the .pth line; where both run, one activation."""
    site = venv["site"]
    line = (site / "omni_patches.start").read_text().strip()
    assert line == "omni_patches._bootstrap:start"
    code = textwrap.dedent(f"""
        import pkgutil, sys
        pkgutil.resolve_name({line!r})()        # what site.py does for a .start file
        import omni_patches.engine as e, fakeomni.loader
        print(e.snapshot().sources, fakeomni.loader.compute(3))
    """)
    out = run(venv["python"], code, OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["registry"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['pth', 'start'] 6"
    # With the .pth line gone (3.15 ignores it), the .start entry point alone activates.
    out = run(venv["python"], code, "-S", OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["registry"],
              PYTHONPATH=str(site))
    assert out.stdout.strip() == "['start'] 6", out.stderr


# -- issue 20: strict mode and messages, as an operator meets them ------------------------------------------
STRICT_LINE = "omni_patches.engine.StrictModeError: omni-patches (OMNI_PATCHES_STRICT=1): "


def _last(out):
    return (out.stderr.strip().splitlines() or [""])[-1]


@pytest.mark.parametrize("env,needle", [
    ({"OMNI_PATCHES": "2"}, "OMNI_PATCHES='2' is not 1/true/yes/on or 0/false/no/off"),
    ({"OMNI_PATCHES": "1", "OMNI_PATCHES_LOG_LEVEL": "loud"}, "OMNI_PATCHES_LOG_LEVEL='loud' is not a logging level"),
    ({"OMNI_PATCHES": "1", "OMNI_PATCHES_LORA_CPU_FUSED_KERNEL": "xx"},
     "OMNI_PATCHES_LORA_CPU_FUSED_KERNEL='xx' is not one of auto|addmm|fp32"),
    ({"OMNI_PATCHES": "1", "OMNI_PATCHES_ASSUME_VERSION": "fake-omni=0.28.0,fake_omni=0.26.0"},
     "fake-omni is named 2 times"),
])
def test_strict_mode_stops_on_every_invalid_value(venv, env, needle):
    """What the README promises: in strict mode an invalid OMNI_PATCHES* value stops the program at the
    first target import (the master switch too, although it leaves the shim off); without, it warns and runs."""
    code = "import fakeomni.loader as m; print('ran', m.compute(3))"
    out = run(venv["python"], code, OMNI_PATCHES_STRICT="1", OMNI_PATCHES_CONFIG=venv["registry"], **env)
    assert out.returncode == 1 and "ran" not in out.stdout, out
    assert _last(out).startswith(STRICT_LINE) and needle in _last(out), out.stderr
    out = run(venv["python"], code, OMNI_PATCHES_CONFIG=venv["registry"], **env)
    assert out.returncode == 0 and out.stdout.startswith("ran"), out
    assert out.stderr.count(needle) == 1, out.stderr  # warned, once


def test_strict_drift_names_the_patch_and_the_target(venv, tmp_path):
    """An upstream release whose code changed shape (a drifted copy ahead on PYTHONPATH)."""
    drifted = tmp_path / "drifted"
    fakes.fake_omni(drifted, "0.28.0", loader="def compute(x, factor=1):\n    return x * factor\n")
    out = run(venv["python"], "import fakeomni.loader; print('ran')", OMNI_PATCHES="1", OMNI_PATCHES_STRICT="1",
              OMNI_PATCHES_CONFIG=venv["registry"], PYTHONPATH=str(drifted))
    assert out.returncode == 1 and "ran" not in out.stdout, out
    last = _last(out)
    assert last.startswith(STRICT_LINE + "fake-double: drifted at fakeomni.loader: "), last
    assert "no parameter(s) scale" in last and "fakepatches.double" in last, last


def test_strict_patch_exception_names_the_patch_and_the_target(venv):
    out = run(venv["python"], "import fakeomni.loader", OMNI_PATCHES="1", OMNI_PATCHES_STRICT="1",
              OMNI_PATCHES_CONFIG=venv["boom"])
    assert out.returncode == 1
    assert _last(out) == (STRICT_LINE + "fake-boom: failed at fakeomni.loader: RuntimeError: boom from a broken "
                          "patch (nothing applied; patch module fakepatches.boom)"), out.stderr


def test_strict_overlay_specifier_names_the_overlay(venv, tmp_path):
    """An overlay that changes a patch of another file: its own mistake is blamed on it, not on that file."""
    overlay = tmp_path / "overlay.toml"
    overlay.write_text('[[patch]]\nid = "fake-double"\nrequires = { "fake-omni" = ">>0.1" }\n')
    out = run(venv["python"], "import fakeomni.loader", OMNI_PATCHES="1", OMNI_PATCHES_STRICT="1",
              OMNI_PATCHES_CONFIG=f"{venv['registry']}:{overlay}")
    assert out.returncode == 1
    last = _last(out)
    assert f"{overlay}: patch 'fake-double': key 'requires'" in last and venv["registry"] not in last, last


def test_huge_master_value_is_not_echoed(venv):
    value = "x" * 100_000
    out = run(venv["python"], "import fakeomni.loader", OMNI_PATCHES=value, OMNI_PATCHES_CONFIG=venv["registry"])
    assert out.returncode == 0 and len(out.stderr) < 1000 and "100000 characters" in out.stderr, len(out.stderr)
    import subprocess

    from support.venvs import clean_env

    exe = venv["python"].parent / "omni-patches"
    for args in (["status"], ["status", "--json"], ["doctor"]):
        out = subprocess.run([str(exe), *args], capture_output=True, text=True,
                             env=clean_env(OMNI_PATCHES=value, OMNI_PATCHES_CONFIG=venv["registry"]))
        assert "100000 characters" in out.stdout and value not in out.stdout + out.stderr, args
        # Quoted cut short wherever it is shown (the output's own length grows with the catalogue).
        longest = max((len(run) for run in re.findall("x+", out.stdout + out.stderr)), default=0)
        assert longest <= 200, (args, longest)


def test_cli_exit_code_survives_a_closed_pipe(venv):
    """`omni-patches list | head`: the reader leaving early changes nothing about the command's exit code."""
    import subprocess

    from support.venvs import clean_env

    exe = venv["python"].parent / "omni-patches"
    for args, code in ((["list"], 0), (["status"], 0), (["doctor"], 0), (["status", "--json"], 0)):
        proc = subprocess.Popen([str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=clean_env(OMNI_PATCHES_CONFIG=venv["registry"]))
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(60) == code and "Traceback" not in err, (args, proc.returncode, err)
    shell = f"'{exe}' list | head -1 >/dev/null; exit ${{PIPESTATUS[0]}}"
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True,
                         env=clean_env(OMNI_PATCHES_CONFIG=venv["registry"]))
    assert out.returncode == 0 and out.stderr == "", out


def test_status_ray_json_without_ray_prints_json(venv, tmp_path):
    import json
    import subprocess

    from support.venvs import clean_env

    exe = venv["python"].parent / "omni-patches"
    for args in (["status", "--ray", "--json"], ["status", "--ray", "--prune", "--json"]):
        out = subprocess.run([str(exe), *args, "--state-dir", str(tmp_path)], capture_output=True, text=True,
                             env=clean_env())
        assert out.returncode == 2, out
        doc = json.loads(out.stdout)
        assert "ray is not importable here" in doc["error"], doc


def test_pythonpath_install_says_pth_files_are_not_read_there(venv, tmp_path):
    """`pip install --target T` + `PYTHONPATH=T`: the package imports, but Python never reads T's .pth."""
    import subprocess
    import sys

    from support.venvs import clean_env, install_source, pip

    target = tmp_path / "target"
    with install_source() as src:
        pip(venv["python"], ["install", "-q", "--disable-pip-version-check", "--target", str(target), str(src)],
            target)
    assert (target / "omni_patches.pth").is_file()
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    out = subprocess.run([str(bare / "bin" / "python"), "-m", "omni_patches", "status"], capture_output=True,
                         text=True, env=clean_env(OMNI_PATCHES="1", PYTHONPATH=str(target)))
    header = out.stdout.splitlines()[0]
    assert "was not set when this interpreter started" not in header, header
    assert f"omni_patches.pth is in {target}, which is on PYTHONPATH" in header, header
    assert "reads .pth files only in site directories" in header, header


@pytest.fixture(scope="module")
def no_wrapt(tmp_path_factory):
    """An image where omni-patches' dependency wrapt is missing (installed --no-deps, packaging added)."""
    root = tmp_path_factory.mktemp("nowrapt")
    python = make_venv(root / "env", no_deps=True, also=("packaging",))
    site = site_packages(python)
    fakes.fake_omni(site, "0.28.0")
    shutil.copytree(fakes.__file__.rsplit("/support/", 1)[0] + "/fakepatches", site / "fakepatches")
    registry = root / "fake.toml"
    registry.write_text(fakes.registry_text(fakes.entry()))
    assert run(python, "import wrapt").returncode != 0
    return python, str(registry)


def test_missing_wrapt_is_failed_not_pending(no_wrapt):
    python, registry = no_wrapt
    code = "import fakeomni.loader as m, omni_patches; print([(s.state, s.reason) for s in omni_patches.status()])"
    out = run(python, code, OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=registry)
    assert out.returncode == 0 and "could not start" in out.stderr, out  # the host runs on, unpatched
    states = eval(out.stdout)
    assert states and all(s == "failed" and "No module named 'wrapt'" in r for s, r in states), states
    import subprocess

    from support.venvs import clean_env

    # doctor, status in a shell (what a process started with OMNI_PATCHES=1 would do), status with it set
    for args, env, code in ((["doctor"], {}, 1), (["status"], {}, 0), (["status"], {"OMNI_PATCHES": "1"}, 1)):
        out = subprocess.run([str(python), "-m", "omni_patches", *args], capture_output=True, text=True,
                             env=clean_env(OMNI_PATCHES_CONFIG=registry, **env))
        assert "Traceback" not in out.stderr and out.returncode == code, (args, out)
        assert "No module named 'wrapt'" in out.stdout and "pending" not in out.stdout, (args, out.stdout)


def test_moved_editable_source_is_one_line(tmp_path):
    """An editable install whose checkout was moved away: every interpreter starts; with OMNI_PATCHES set it
    says so in one line, without it nothing at all."""
    from support.venvs import project_copy

    src = project_copy(tmp_path / "src")
    python = make_venv(tmp_path / "env", editable=True, project=src)
    src.rename(tmp_path / "moved")
    out = run(python, "print('ran')", OMNI_PATCHES="1")
    assert out.returncode == 0 and out.stdout == "ran\n", out
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert "omni_patches package cannot be imported" in out.stderr, out.stderr
    out = run(python, "print('ran')")
    assert out.returncode == 0 and out.stdout == "ran\n" and out.stderr == "", out
