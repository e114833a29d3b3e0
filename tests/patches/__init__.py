"""One package per real patch, named after its module in ``omni_patches/patches/``: its contract case
(``case.py``, defining ``CASE = support.contract.Case(...)``), its tests (``test_*.py``) and the sandboxes, child
scripts and scenarios only it uses. What several patches use lives in ``tests/support``. Imported as
``patches.<module>.<name>`` with tests/ on ``sys.path`` (conftest.py; children get it on ``PYTHONPATH``)."""
