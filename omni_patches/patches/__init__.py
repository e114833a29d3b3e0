"""One module per patch. Each opens with its record and defines ``apply(ctx)`` (and optionally ``check(ctx)``).

Record: the module docstring, the one source of the patch's prose, and ``TABLE``, its machine keys (``default``,
``requires``, ``fixed_in``, ``targets``; optionally ``source_builds``, ``needs``), from which
``python -m omni_patches.tools.tables --write`` generates its ``patches.toml`` table and the README's row. The
registry reads ``summary`` (the first line), ``upstream`` (the URLs of ``Upstream:``), ``why`` and
``remove_when`` from here, parsing the source without importing it (:mod:`omni_patches.prose`), for ``omni-patches
list`` (the README table), ``status`` and ``doctor``. ``tests/test_records.py`` checks the Affected line against
``requires`` / ``fixed_in`` and that it fits a screenful: at most 25 lines, these fields in this order, each label at
the start of a line and its continuation lines indented::

    <patch-id>: <one-line summary>

    Why:         the bug and its symptom, in 2-4 lines
    Upstream:    PR / issue URLs (they are the patch's ``upstream`` list: other references without a URL)
    Affected:    <dist> <specifier> (TABLE's ``requires``); fixed upstream in <dist> <version> (its ``fixed_in``)
    How:         the mechanism in a few lines: what is wrapped, and why this technique
    Remove when: the condition under which the patch can be deleted

Measurements, layouts per version, findings and how the patch is tested go to its ``## `<patch-id>``` section in
``docs/patches.md``, which never restates the record (``tests/test_records.py`` checks).

Contract with the engine (:mod:`omni_patches.context`):

* ``check(ctx)`` / ``apply(ctx)`` run once per target module when it is first imported; ``ctx.target`` is its
  name, ``ctx.module`` the module. Do not import other targets from here.
* Change things only through ``ctx.wrap(owner, name, wrapper)`` (wrapt), ``ctx.replace(owner, name, make)``
  (plain function, hot paths) and ``ctx.on_undo(fn)``: that is what makes a patch idempotent, undoable and
  dry-runnable (``omni-patches doctor`` calls ``apply`` with ``ctx.dry_run`` set; wrap/replace then only verify).
* Detect drift with ``ctx.resolve(path)``, ``ctx.has(path)``, ``ctx.require_params(func, *names)`` or
  ``ctx.drift(msg)``; report an upstream fix found by feature with ``ctx.fixed_upstream(msg)``.
* Keep wrappers cheap and free of imports of heavy modules at call time; never raise from a wrapper for a
  reason of the patch's own (fall back to calling the original).
"""
