"""The hot image cache: keep, link, budget and LRU, leftovers of a crash, EXDEV, bad names, threads."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from pathlib import Path

import pytest

from crabd.backends.criu import hotimages
from crabd.backends.criu.hotimages import HotImages

BOOT = "boot-a"


def _m(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


def _dump(d: Path, size: int = 1000, tag: str = "") -> Path:
    """A dump dir of ``size`` + a few bytes."""
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes((tag.encode() or b"x") * (size // max(1, len(tag) or 1)))
    (d / "core-1.img").write_bytes(b"core " + tag.encode())
    return d


def _nbytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir())


def _contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _hot(tmp_path: Path, budget: int = 1 << 20, boot: str = BOOT) -> HotImages:
    return HotImages(tmp_path / "hot", budget, boot_id=boot)


def _target(tmp_path: Path, name: str = "target") -> Path:
    t = tmp_path / name
    t.mkdir()
    return t


def test_keep_takes_the_dir_over_and_link_into_shares_its_inodes(tmp_path: Path) -> None:
    hot = _hot(tmp_path)
    d = _dump(tmp_path / "dumps" / "images", tag="a")
    want, size = _contents(d), _nbytes(d)
    assert hot.keep(_m("a"), d, "sb1")
    assert not d.exists()  # renamed, not copied
    entry = tmp_path / "hot" / _m("a")
    assert _contents(entry) == want
    assert stat.S_IMODE((tmp_path / "hot").stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in entry.iterdir()} == {0o400}
    assert hot.usage() == (1, size)

    t = _target(tmp_path)
    assert hot.link_into(_m("a"), t) == size
    assert _contents(t) == want
    for p in t.iterdir():
        assert p.stat().st_ino == (entry / p.name).stat().st_ino  # a hard link, no copy
    assert hot.link_into(_m("b"), _target(tmp_path, "t2")) is None


def test_bad_manifest_names_never_become_paths(tmp_path: Path) -> None:
    hot = _hot(tmp_path)
    d = _dump(tmp_path / "d")
    bad = ["", "..", "../x", _m("a").upper(), _m("a")[:63], _m("a") + "0", f"{_m('a')[:60]}/../", "tmp-" + _m("a")]
    for name in bad:
        assert not hot.keep(name, d, "sb")
        assert hot.link_into(name, tmp_path) is None
        hot.drop(name)
    assert d.exists() and sorted(os.listdir(tmp_path / "hot")) == [hotimages.BOOT_MARK]


def test_a_sandbox_keeps_its_newest_dumps_and_what_it_restored_from(tmp_path: Path) -> None:
    hot = _hot(tmp_path)
    n = hotimages.PER_SANDBOX
    assert hot.keep(_m("b1"), _dump(tmp_path / "b1", tag="b1"), "b")
    for i in range(n):
        assert hot.keep(_m(f"a{i}"), _dump(tmp_path / f"a{i}", tag=f"a{i}"), "a")
    assert all(_m(f"a{i}") in hot for i in range(n))
    # A restore of a0 into a: it stays among a's newest, though a dumps anew after it.
    assert hot.link_into(_m("a0"), _target(tmp_path, "r0"), "a") is not None
    assert hot.keep(_m(f"a{n}"), _dump(tmp_path / f"a{n}", tag=f"a{n}"), "a")
    assert _m("a0") in hot and _m("a1") not in hot and _m(f"a{n}") in hot
    assert not (tmp_path / "hot" / _m("a1")).exists()
    # An entry another sandbox holds (a fork restored from it) outlives its maker's newer dumps.
    assert hot.link_into(_m("a2"), _target(tmp_path, "r1"), "clone") is not None
    for i in range(n + 1, 2 * n + 1):
        assert hot.keep(_m(f"a{i}"), _dump(tmp_path / f"a{i}", tag=f"a{i}"), "a")
    assert _m("a2") in hot and _m("a0") not in hot and _m("b1") in hot
    assert hot.usage()[0] == n + 2


def test_the_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    size = _nbytes(_dump(tmp_path / "probe", tag="a"))
    hot = _hot(tmp_path, budget=2 * size)
    for tag in ("a", "b"):
        assert hot.keep(_m(tag), _dump(tmp_path / tag, tag=tag), tag)
    assert hot.link_into(_m("a"), _target(tmp_path)) == size  # a is now the most recently used
    assert hot.keep(_m("c"), _dump(tmp_path / "c", tag="c"), "c")
    assert (_m("a") in hot, _m("b") in hot, _m("c") in hot) == (True, False, True)
    assert hot.usage() == (2, 2 * size)
    assert sorted(os.listdir(tmp_path / "hot")) == sorted([_m("a"), _m("c"), hotimages.BOOT_MARK])


def test_too_big_no_budget_or_a_duplicate_is_left_to_the_caller(tmp_path: Path) -> None:
    d = _dump(tmp_path / "d", size=5000, tag="a")
    assert not _hot(tmp_path, budget=100).keep(_m("a"), d, "sb")
    assert not HotImages(tmp_path / "off", 0, boot_id=BOOT).keep(_m("a"), d, "sb")
    assert d.exists()
    hot = _hot(tmp_path)
    assert hot.keep(_m("a"), d, "sb")
    again = _dump(tmp_path / "again", size=5000, tag="a")
    assert not hot.keep(_m("a"), again, "other")  # the same dump from another sandbox
    assert again.exists() and hot.usage()[0] == 1
    # A dir holding anything but regular files is not taken.
    odd = _dump(tmp_path / "odd", tag="o")
    (odd / "sub").mkdir()
    assert not hot.keep(_m("o"), odd, "sb") and odd.exists()
    link = _dump(tmp_path / "link", tag="l")
    (link / "evil").symlink_to("/etc/shadow")
    assert not hot.keep(_m("l"), link, "sb") and link.exists()


def test_leftovers_of_a_crash_go_and_entries_stay_within_one_boot(tmp_path: Path) -> None:
    hot = _hot(tmp_path)
    assert hot.keep(_m("a"), _dump(tmp_path / "a", tag="a"), "sb")
    root = tmp_path / "hot"
    _dump(root / f"tmp-{_m('b')}-0123abcd", tag="b")  # a keep() killed before its rename
    _dump(root / f"old-{_m('c')}-0123abcd", tag="c")  # a drop() killed before its rmtree
    bad = _dump(root / _m("d"), tag="d")  # an entry someone put a symlink into
    (bad / "x").symlink_to("/etc/passwd")
    (root / "unrelated").write_text("not ours to judge")

    again = _hot(tmp_path)  # crabd restarted, same boot: the page cache holds the entries
    assert sorted(os.listdir(root)) == sorted([_m("a"), hotimages.BOOT_MARK, "unrelated"])
    assert again.usage() == (1, _nbytes(root / _m("a")))
    assert again.link_into(_m("a"), _target(tmp_path)) is not None

    rebooted = _hot(tmp_path, boot="boot-b")  # never fsynced: after a reboot they may be short
    assert rebooted.usage() == (0, 0)
    assert sorted(os.listdir(root)) == sorted([hotimages.BOOT_MARK, "unrelated"])
    assert (root / hotimages.BOOT_MARK).read_text().strip() == "boot-b"

    assert rebooted.keep(_m("e"), _dump(tmp_path / "e", tag="e"), "sb")
    assert _hot(tmp_path, budget=0, boot="boot-b").usage() == (0, 0)  # a budget of 0 empties it
    assert not (root / _m("e")).exists()


def test_exdev_keep_is_refused_and_link_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hot = _hot(tmp_path)
    d = _dump(tmp_path / "d", tag="a")
    real_rename, real_link = os.rename, os.link

    def cross_rename(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "rename", cross_rename)
    assert not hot.keep(_m("a"), d, "sb")
    assert d.exists() and hot.usage() == (0, 0)
    monkeypatch.setattr(os, "rename", real_rename)
    want = _contents(d)
    assert hot.keep(_m("a"), d, "sb")

    def cross_link(*args: object, **kw: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_link)
    t = _target(tmp_path)
    assert hot.link_into(_m("a"), t) == sum(len(v) for v in want.values())
    assert _contents(t) == want
    entry = tmp_path / "hot" / _m("a")
    for p in t.iterdir():
        assert p.stat().st_ino != (entry / p.name).stat().st_ino  # copied
    monkeypatch.setattr(os, "link", real_link)


def test_an_entry_that_vanishes_midway_leaves_the_target_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hot = _hot(tmp_path)
    d = _dump(tmp_path / "d", tag="a")
    (d / "zz-last.img").write_bytes(b"last")
    assert hot.keep(_m("a"), d, "sb")
    real_link = os.link
    calls = []

    def link_then_evict(*args: object, **kw: object) -> None:
        real_link(*args, **kw)  # type: ignore[arg-type]
        calls.append(1)
        if len(calls) == 1:
            hot.drop(_m("a"))  # evicted by another thread between two links

    monkeypatch.setattr(os, "link", link_then_evict)
    t = _target(tmp_path)
    assert hot.link_into(_m("a"), t) is None
    assert list(t.iterdir()) == []
    assert hot.usage() == (0, 0)
    monkeypatch.setattr(os, "link", real_link)

    # Removed behind the cache's back: it notices, and forgets the entry.
    assert hot.keep(_m("b"), _dump(tmp_path / "b", tag="b"), "sb")
    import shutil

    shutil.rmtree(tmp_path / "hot" / _m("b"))
    assert hot.link_into(_m("b"), t) is None
    assert list(t.iterdir()) == [] and _m("b") not in hot


def test_a_failed_link_leaves_the_target_empty_and_raises(tmp_path: Path) -> None:
    hot = _hot(tmp_path)
    assert hot.keep(_m("a"), _dump(tmp_path / "d", tag="a"), "sb")
    t = _target(tmp_path)
    (t / "pages-1.img").write_bytes(b"someone else's")  # not empty: the second link collides
    with pytest.raises(FileExistsError):
        hot.link_into(_m("a"), t)
    assert sorted(os.listdir(t)) == ["pages-1.img"]
    assert (t / "pages-1.img").read_bytes() == b"someone else's"


def test_drop_and_clear(tmp_path: Path) -> None:
    hot = _hot(tmp_path)
    for tag in ("a", "b", "c"):
        assert hot.keep(_m(tag), _dump(tmp_path / tag, tag=tag), tag)
    hot.drop(_m("b"))
    hot.drop(_m("zz"))  # no such entry: nothing happens
    assert hot.usage()[0] == 2 and _m("b") not in hot
    hot.clear()
    assert hot.usage() == (0, 0)
    assert os.listdir(tmp_path / "hot") == [hotimages.BOOT_MARK]


def test_concurrent_keeps_and_links(tmp_path: Path) -> None:
    size = _nbytes(_dump(tmp_path / "probe", size=20_000, tag="p"))
    hot = _hot(tmp_path, budget=3 * size)
    dumps: dict[str, dict[str, bytes]] = {}
    for i in range(24):
        tag = f"{i:02d}"
        d = _dump(tmp_path / "src" / tag, size=20_000, tag=tag)
        dumps[tag] = _contents(d)
    errors: list[BaseException] = []
    linked: list[int] = []

    def keeper(tags: list[str], sandbox: str) -> None:
        try:
            for tag in tags:
                if not hot.keep(_m(tag), tmp_path / "src" / tag, sandbox):
                    raise AssertionError(f"not kept: {tag}")
        except BaseException as exc:
            errors.append(exc)

    def linker(n: int) -> None:
        try:
            for k in range(60):
                tag = f"{(k * 7 + n) % 24:02d}"
                t = tmp_path / "targets" / f"{n}-{k}"
                t.mkdir(parents=True)
                got = hot.link_into(_m(tag), t)
                if got is None:
                    assert list(t.iterdir()) == []
                else:
                    assert _contents(t) == dumps[tag]  # complete and exact, or nothing
                    linked.append(got)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=keeper, args=([f"{i:02d}" for i in range(s, 24, 4)], f"sb{s}")) for s in range(4)
    ]
    threads += [threading.Thread(target=linker, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    entries, used = hot.usage()
    assert used <= 3 * size and entries <= 3
    names = set(os.listdir(tmp_path / "hot")) - {hotimages.BOOT_MARK}
    assert not any(n.startswith(("tmp-", "old-")) for n in names)
    assert len(names) == entries
