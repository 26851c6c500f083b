from __future__ import annotations

from pathlib import Path

import pytest

from crabd.errors import ImageError
from crabd.host import images


def _recipe(d: Path, body: str) -> images.Recipe:
    d.mkdir(parents=True, exist_ok=True)
    (d / "image.toml").write_text(body)
    return images.load_recipe(d)


def test_content_tag_tracks_recipe_and_overlay(tmp_path: Path) -> None:
    r1 = _recipe(tmp_path / "a", 'name = "a"\nbuilder = "busybox"\n')
    tag1 = r1.content_tag
    assert r1.image_ref == f"crab-env/a:{tag1}"
    assert images.load_recipe(tmp_path / "a").content_tag == tag1  # stable
    (tmp_path / "a" / "rootfs").mkdir()
    (tmp_path / "a" / "rootfs" / "f").write_text("x")
    tag2 = images.load_recipe(tmp_path / "a").content_tag
    assert tag2 != tag1
    (tmp_path / "a" / "rootfs" / "f").write_text("y")
    assert images.load_recipe(tmp_path / "a").content_tag not in (tag1, tag2)


def test_unknown_key_and_builder_rejected(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="unknown keys"):
        _recipe(tmp_path / "b", 'name = "b"\nbuilder = "busybox"\nfoo = 1\n')
    with pytest.raises(ImageError, match="builder"):
        _recipe(tmp_path / "c", 'name = "c"\nbuilder = "apk"\n')


def test_repo_recipes_exist() -> None:
    names = {r.name for r in images.list_recipes()}
    assert {"bookworm", "busybox"} <= names
    with pytest.raises(ImageError, match="known envs"):
        images.find_recipe("nope")
