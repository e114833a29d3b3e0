"""Real interpreters: a fresh venv with the project pip-installed, its .pth acting at start-up."""
import shutil
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
        print(e._state.sources, fakeomni.loader.compute(3))
    """)
    out = run(venv["python"], code, OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["registry"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['pth', 'start'] 6"
    # With the .pth line gone (3.15 ignores it), the .start entry point alone activates.
    out = run(venv["python"], code, "-S", OMNI_PATCHES="1", OMNI_PATCHES_CONFIG=venv["registry"],
              PYTHONPATH=str(site))
    assert out.stdout.strip() == "['start'] 6", out.stderr
