"""The chapter map, its picture, and show_source: the course's own plumbing."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from paged_lib.course import show_source  # noqa: E402
from paged_lib.course.chapters import CHAPTERS  # noqa: E402
from paged_lib.course.demos.tour import add_kernel  # noqa: E402
from paged_lib.course.viz.chapters import chapter_map  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_chapters_are_numbered_in_order_and_name_their_files():
    assert [c.number for c in CHAPTERS] == [f"{i:02d}" for i in range(len(CHAPTERS))]
    for ch in CHAPTERS:
        if ch.available(ROOT):
            for folder in ("notebooks", "solutions", "exercises")[:3 if ch.exercises else 1]:
                assert (ROOT / folder / f"{ch.number}_{ch.slug}.ipynb").exists()
    on_disk = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert on_disk == [Path(c.notebook).name for c in CHAPTERS if c.available(ROOT)]
    assert [c.available() for c in CHAPTERS] == [c.available(ROOT) for c in CHAPTERS], \
        "available() without a root must look in this checkout (chapter 00's map calls it so)"


def test_chapter_map_fades_missing_chapters(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / CHAPTERS[0].notebook).touch()
    fig = chapter_map(tmp_path)
    patches = fig.axes[0].patches
    assert len(patches) == len(CHAPTERS)
    assert patches[0].get_alpha() > patches[1].get_alpha()
    plt.close(fig)


def test_show_source_shows_a_triton_kernel_as_python():
    md = show_source(add_kernel)
    assert md.data.startswith("```python\n@triton.jit\ndef add_kernel(")
    assert md.data.endswith("```")
