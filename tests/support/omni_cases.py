"""What the contract cases of the vllm-omni patches on real release files share (tests/patches/omni_*/case.py): their
sandbox environments and the skipped and source-build variants every one of them declares."""
from __future__ import annotations

from omni_patches.testing import Env

FIXED = ("0.31.0rc1", "0.32.0rc1")  # upstream's fixed releases, for every omni stage / sleep patch
METADATA = "vllm_omni-{}.dist-info/METADATA"


def sandboxes(paths):
    """``sandbox(version, env=None, **kw)``: the Env ``omni-<version>`` importing from ``paths(version)``, with the
    variant's own ``env`` (the contract's child switches off the sibling patches on the same targets itself)."""

    def sandbox(version, env=None, **kw):
        return Env(f"omni-{version}", lambda: paths(version), env=dict(env or {}), **kw)

    return sandbox


def skipped(sandbox, base: str, switch: str, *, backport: tuple, outside: str, fixed=FIXED) -> list:
    """Upstream's ``fixed`` releases; ``base`` with upstream's fix found by feature although its version is affected
    (a vendor backport: ``backport`` is ``(relpath, old, new)``, an edit of the real file); ``base`` with the
    patch's ``switch`` at 0; ``outside``, the newest release before the patch's range."""
    return [
        *[(sandbox(v), "skipped:version", "fixed upstream") for v in fixed],
        (Env.edited(f"omni-{base}-backported", sandbox(base), *backport), "skipped:version", "fixed upstream"),
        (sandbox(base, env={switch: "0"}), "skipped:disabled", f"{switch}=0"),
        (sandbox(outside), "skipped:version", "outside"),
    ]


def source_built(sandbox, base: str, dev: str, fixed: str) -> list:
    """``base`` installed as a checkout of its line (setuptools_scm number ``dev``) applies, decided by code
    features; ``fixed`` installed as a checkout without tags (``0.0.0``) skips: the code decides."""
    return [
        (Env.source_build(sandbox(base), METADATA.format(base), base, dev), "applied", "decided by code features"),
        (Env.source_build(sandbox(fixed), METADATA.format(fixed), fixed, "0.0.0"), "skipped:version",
         "fixed upstream"),
    ]
