"""omni_patches.tools.atomic: the build-once cache entries audit and the test-suite share."""
import multiprocessing
import os
import tarfile
import zipfile

import pytest

from omni_patches.tools import atomic


def _fill_slowly(tmp, log):
    with open(log, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    with open(os.path.join(tmp, "payload"), "w") as fh:
        fh.write("x" * 1000)


def _build(dest, cache, log):
    atomic.build_once(dest, lambda tmp: _fill_slowly(tmp, log), cache=cache)


def test_built_once_by_concurrent_processes(tmp_path):
    dest, log = tmp_path / "entry", tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build, args=(str(dest), str(tmp_path), str(log))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(log.read_text().split()) == 1  # one builder; the others found it complete
    assert (dest / "payload").read_text() == "x" * 1000 and atomic.is_complete(dest)


def test_a_failed_build_leaves_nothing_and_a_new_marker_rebuilds(tmp_path):
    dest = tmp_path / "entry"

    def boom(tmp):
        (tmp_path / "seen").write_text(tmp)
        raise RuntimeError("killed mid-way")

    with pytest.raises(RuntimeError):
        atomic.build_once(dest, boom, cache=tmp_path)
    assert not dest.exists() and not os.path.exists((tmp_path / "seen").read_text())
    atomic.build_once(dest, lambda tmp: open(os.path.join(tmp, "v"), "w").write("1"), cache=tmp_path, marker="one")
    atomic.build_once(dest, lambda tmp: open(os.path.join(tmp, "v"), "w").write("2"), cache=tmp_path, marker="one")
    assert (dest / "v").read_text() == "1"  # complete the same way: kept
    atomic.build_once(dest, lambda tmp: open(os.path.join(tmp, "v"), "w").write("3"), cache=tmp_path, marker="two")
    assert (dest / "v").read_text() == "3" and atomic.is_complete(dest, "two")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["entry", "seen"]


@pytest.mark.parametrize("name,why", [("/etc/x", "an absolute path"), ("a/../../x", "a '..' component"),
                                      ("C:x", "an absolute path")])
def test_unsafe_members_are_refused_before_anything_is_written(tmp_path, name, why):
    wheel = tmp_path / "bad.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("ok.py", "1")
        zf.writestr(name, "2")
    out = tmp_path / "out"
    with pytest.raises(atomic.UnsafeArchive, match=why.replace("(", r"\(")):
        atomic.extract(wheel, out)
    assert not out.exists() or not any(out.rglob("*"))


def test_extract_takes_only_wanted_regular_files(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("a")
    (src / "pkg" / "b.so").write_text("b")
    os.symlink("a.py", src / "pkg" / "link.py")
    sdist = tmp_path / "pkg-1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(src / "pkg", arcname="pkg-1/pkg")
    atomic.extract(sdist, tmp_path / "out", lambda n: n.endswith(".py"))
    got = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert got == ["pkg-1/pkg/a.py"]


def test_link_or_copy_links_where_it_can_and_copies_where_it_cannot(tmp_path, mocker):
    src = tmp_path / "src.py"
    src.write_text("upstream\n")
    linked = atomic.link_or_copy(src, tmp_path / "linked.py")
    assert os.path.samefile(src, linked)
    link = mocker.patch("os.link", side_effect=OSError(18, "Invalid cross-device link"))
    copied = atomic.link_or_copy(src, tmp_path / "copied.py")
    assert link.call_count == 1
    assert not os.path.samefile(src, copied) and copied.read_text() == "upstream\n"
    # An edit replaces the linked file (what wheels.tagless and Env.edited do): the source is untouched.
    linked.unlink()
    linked.write_text("edited\n")
    assert src.read_text() == "upstream\n"
