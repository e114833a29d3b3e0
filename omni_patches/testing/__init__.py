"""The contract every patch passes, as a harness: for the built-in patches (tests/test_contract.py) and for an
operator's overlay patch (``OMNI_PATCHES_CONFIG``). Describe where the patch's targets live with :class:`Case`
/ :class:`Env` / :class:`Unexpected` in a module that defines ``CASE``, then run each of :func:`parts` with
:func:`check` -- each in an interpreter of its own (a fork of :mod:`omni_patches.testing.zygote`, which imported
torch once and nothing of omni-patches, vLLM or the case; ``OMNI_TESTING_ZYGOTE=0``: one started for it alone)::

    import pytest
    from omni_patches import testing

    @pytest.mark.parametrize("kind,index,label", testing.parts(my_case.CASE))
    def test_contract(kind, index, label):
        assert testing.check("my_case", kind, index, pythonpath=[HERE])["ok"]

:func:`run_code` runs a test's own ``python -c`` scenario the same way (forked, unless its environment turns the
shim on at start). What the contract checks is in :mod:`omni_patches.testing.contract`.

Where a case's targets come from: :class:`Release` (:mod:`omni_patches.testing.releases`), the one builder of
release environments -- the real files of a release from PyPI (cached, hard-linked), its metadata as released or
as a source build, and stand-ins (:mod:`omni_patches.testing.standins`) only for what cannot run here::

    LOADER = Release("vllm-omni", "0.28.0", files=["vllm_omni/diffusion/lora/loader.py"], auto_standins=True)
    CASE = Case("my-patch", affected=[LOADER.env()])
    LOADER.call(scenario, 2)   # a module-level function of the test, run in a child on those files

Test-only: never imported by a serving process.
"""
from .contract import KINDS, Case, Env, Unexpected, cache_dir, check, parts, run_code
from .releases import AUTO, VLLM_LOGGER, Release, fake

__all__ = ["Case", "Env", "Unexpected", "check", "parts", "cache_dir", "run_code", "KINDS", "Release", "AUTO",
           "VLLM_LOGGER", "fake"]
