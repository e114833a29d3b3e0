"""CONTRIBUTING's "How to add a patch" stays true: the files it lists are every patch's, and the commit that added a
patch since the patch kit touched no other file by hand."""
import re
import subprocess
from pathlib import Path

import pytest

from omni_patches import registry

ROOT = Path(__file__).resolve().parents[1]
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
SPECS = registry.load([registry.builtin_path()]).specs
#: Patches that arrived before the patch kit (issue 36), with more files each; every later one is checked.
BEFORE_THE_KIT = frozenset({
    "lora-accel-delta", "lora-cpu-fused-delta", "moe-ep-parallel-mapping", "moe-lora-idle-detach",
    "ascend-moe-skip-idle-lora", "omni-stage-shutdown-nonblocking", "omni-stage-send-dead-engine",
    "omni-diffusion-sleep-wake-errors", "omni-stage-executor-failure-teardown", "ascend-allgather-finalize-order",
    "ascend-execute-model-timeout", "vllm-moe-lora-stale-token-ids"})


def _listed():
    """``(hand-written templates, generated, optional)`` from the marked block of CONTRIBUTING.md."""
    block = re.search(r"<!-- add-a-patch:files -->(.*?)<!-- /add-a-patch:files -->", CONTRIBUTING.read_text(), re.S)
    assert block, "CONTRIBUTING.md lost its add-a-patch:files block"
    text = block.group(1)
    hand = re.findall(r"^- `([^`]+)`", text, re.M)
    generated = re.findall(r"`([^`]+)`", text.split("Generated:", 1)[1].split("Optional", 1)[0])
    optional = re.findall(r"`([^`/]+/?[^`]*)`", text.split("Optional", 1)[1])
    return hand, generated, [o for o in optional if "/" in o or o.endswith(".md")]


def _name(pid):
    return SPECS[pid].module.rsplit(".", 1)[1]


def test_the_list_names_three_hand_written_files_and_the_generated_tables():
    hand, generated, optional = _listed()
    assert hand == ["omni_patches/patches/<name>.py", "tests/patches/<name>/case.py",
                    "tests/patches/<name>/test_<name>.py"], hand
    assert generated == ["patches.toml", "README.md"], generated
    assert optional == ["docs/patches.md", "bench/"], optional


@pytest.mark.parametrize("pid", sorted(SPECS))
def test_every_patch_has_the_listed_files(pid):
    name = _name(pid)
    hand, _, _ = _listed()
    for template in hand:
        path = template.replace("<name>", name)
        if pid in BEFORE_THE_KIT and path.endswith(f"test_{name}.py"):  # older folders name their tests freely
            assert list((ROOT / path).parent.glob("test_*.py")), f"{pid}: no test in {Path(path).parent}"
            continue
        assert (ROOT / path).is_file(), f"{pid}: {path} is missing (CONTRIBUTING.md, How to add a patch)"


def _git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("pid", sorted(set(SPECS) - BEFORE_THE_KIT))
def test_the_commit_that_added_a_patch_touched_only_the_listed_files(pid):
    if _git("rev-parse", "--is-inside-work-tree").returncode != 0:
        pytest.skip("not a git checkout: no history to read")
    name = _name(pid)
    module = f"omni_patches/patches/{name}.py"
    added = _git("log", "--diff-filter=A", "--format=%H", "--", module).stdout.split()
    if not added:
        pytest.skip(f"{module} is not committed yet (or the clone is too shallow to see its first commit)")
    commit = added[-1]
    touched = [p for p in _git("show", "--name-only", "--format=", commit).stdout.splitlines() if p]
    hand, generated, optional = _listed()
    allowed_hand = {t.replace("<name>", name) for t in hand}
    outside = [p for p in touched if p not in allowed_hand and p not in generated
               and not any(p == o or (o.endswith("/") and p.startswith(o)) for o in optional)]
    assert not outside, (f"{pid}: its commit {commit[:10]} touched {outside} by hand; CONTRIBUTING.md's "
                         f"'How to add a patch' lists {sorted(allowed_hand)}")
    # At most four hand-written files for the patch itself: the listed three and its docs section (a benchmark of a
    # hot path is a deliverable of its own, CONTRIBUTING "Benchmarks"; the patches of issue 37 also wrote
    # patches.toml by hand, before the registry table moved into the module: it is generated now).
    assert len([p for p in touched if p not in generated and not p.startswith("bench/")]) <= 4, touched
