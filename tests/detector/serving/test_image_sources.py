"""image_sources: the on-disk input index bulk prediction reads (order, lists, fingerprint, memory maps)."""

import os

import numpy as np
import pytest
from PIL import Image

from detector.errors import ConfigError
from detector.serving import image_sources


@pytest.fixture
def tree(tmp_path):
    """b/ and a/ folders (sorted walk), a non-image, a list file with a relative and an absolute path."""
    rng = np.random.default_rng(0)
    for name in ("b/2.png", "a/x/1.jpg", "a/0.PNG", "c.webp"):
        path = tmp_path / "photos" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (9, 7, 3), np.uint8)).save(
            path, format=path.suffix[1:].upper().replace("JPG", "JPEG")
        )
    (tmp_path / "photos" / "notes.md").write_text("not an image")
    (tmp_path / "list.txt").write_text(f"# comment\nphotos/c.webp\n\n{tmp_path / 'photos/b/2.png'}\n")
    return tmp_path


def test_index_walks_folders_sorted_then_files_then_lists(tree, tmp_path):
    index = image_sources.build_file_index(
        [str(tree / "photos"), str(tree / "photos/c.webp"), str(tree / "list.txt")], str(tmp_path / "index")
    )
    photos = str(tree / "photos")
    expected = [f"{photos}/a/0.PNG", f"{photos}/a/x/1.jpg", f"{photos}/b/2.png", f"{photos}/c.webp"]
    expected += [f"{photos}/c.webp", f"{photos}/c.webp", f"{photos}/b/2.png"]
    assert len(index) == 7
    assert [index.name(i) for i in range(7)] == expected
    assert [index.image_id(i) for i in range(7)] == list(range(7))
    assert index.read(2).shape == (9, 7, 3)
    # Reopened from disk: the same paths and fingerprint.
    again = image_sources.FileIndex(str(tmp_path / "index"))
    assert again.fingerprint == index.fingerprint and again.name(6) == expected[6]


def test_fingerprint_follows_names_and_order(tree, tmp_path):
    a = image_sources.build_file_index([str(tree / "photos")], str(tmp_path / "a"))
    b = image_sources.build_file_index([str(tree / "photos")], str(tmp_path / "b"))
    c = image_sources.build_file_index([str(tree / "photos/c.webp"), str(tree / "photos")], str(tmp_path / "c"))
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_offsets_go_to_disk_in_chunks(tree, tmp_path):
    small = image_sources.build_file_index([str(tree / "photos")], str(tmp_path / "small"), chunk=2)
    whole = image_sources.build_file_index([str(tree / "photos")], str(tmp_path / "whole"))
    assert [small.name(i) for i in range(len(small))] == [whole.name(i) for i in range(len(whole))]
    assert small.fingerprint == whole.fingerprint


def test_bad_inputs_are_one_line_errors(tree, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no images"):
        image_sources.build_file_index([str(tmp_path / "empty")], str(tmp_path / "i1"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        image_sources.build_file_index([str(tmp_path / "nowhere")], str(tmp_path / "i2"))
    index = image_sources.build_file_index([str(tree / "photos")], str(tmp_path / "i3"))
    os.truncate(tmp_path / "i3" / image_sources.OFFSETS_FILE, 8)
    with pytest.raises(ConfigError, match="damaged; delete that folder"):
        image_sources.FileIndex(str(tmp_path / "i3"))
    del index


def test_unreadable_images_raise_one_line(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(tmp_path / "ok.png")
    (tmp_path / "list.txt").write_text("broken.jpg\nmissing.png\nok.png\n")
    index = image_sources.build_file_index([str(tmp_path / "list.txt")], str(tmp_path / "index"))
    for position in (0, 1):
        with pytest.raises(image_sources.UnreadableImage) as caught:
            index.read(position)
        assert "\n" not in str(caught.value) and str(caught.value)
    assert index.read(2).shape == (5, 5, 3)


def test_exif_rotation_is_applied(tmp_path):
    image = Image.fromarray(np.zeros((10, 30, 3), np.uint8))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    image.save(tmp_path / "rotated.jpg", exif=exif)
    assert image_sources.read_image_file(str(tmp_path / "rotated.jpg")).shape == (30, 10, 3)
