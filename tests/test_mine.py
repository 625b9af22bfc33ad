"""Your pieces, saved: a passing engine exercise writes its cell's code to mine/.

What a learner's slip would break: code saved although it failed, a passing version
lost to a later failing attempt, a saved file that does not import on its own (an import
or a notebook helper left out), a verdict that changes because of saving.
"""

import linecache
import textwrap
from pathlib import Path

import nbformat
import pytest

from paged_lib.course import grading, mine, notebooks
from paged_lib.course.exercises import SAVED
from paged_lib.course.grading import ch03, ch05, ch06, ch07, ch08, ch10, ch11, ch12

_cells = iter(range(10**6))


def cell(source: str) -> dict:
    """Run ``source`` as IPython runs a cell: compiled from a file name ipykernel uses,
    its text in linecache (where inspect.getsource and mine read it)."""
    source = textwrap.dedent(source)
    name = f"/tmp/ipykernel_4242/{next(_cells)}.py"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    space = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), space)
    return space


RIGHT = """
from paged_lib.engine import SequenceGroup

NEWEST = -1

def _newest(groups):
    return groups[NEWEST]

def my_victim(running: list[SequenceGroup]) -> SequenceGroup:
    return _newest(running)
"""
WRONG = "def my_victim(running):\n    return running[0]\n"  # the oldest: a typical slip


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))
    return tmp_path / "mine"


def test_only_passing_code_is_saved_and_a_failure_keeps_it(folder, capsys):
    ch07.check_choose_victim(cell(WRONG)["my_victim"])
    assert capsys.readouterr().out.startswith("❌ [07.2]")
    assert not (folder / "ch07.py").exists() and mine.saved(folder) == []

    ch07.check_choose_victim(cell(RIGHT)["my_victim"])
    out = capsys.readouterr().out
    assert out.startswith("✅ [07.2] Which group to preempt: correct\n")
    assert "saved to mine/ch07.py" in out and "from mine.ch07 import choose_victim" in out
    saved = (folder / "ch07.py").read_text()
    assert "NEWEST = -1" in saved and "def _newest(groups):" in saved  # its helpers too
    assert "from paged_lib.engine.sequence import SequenceGroup" in saved
    assert "choose_victim = my_victim" in saved  # the stub's name, whatever it was called

    ch07.check_choose_victim(cell(WRONG)["my_victim"])
    out = capsys.readouterr().out
    assert out.startswith("❌ [07.2]") and "keeps your earlier 07.2 that passed" in out
    assert (folder / "ch07.py").read_text() == saved

    victim = mine.load("07.2", folder)
    assert victim(["old", "new"]) == "new" and victim.__module__.startswith("mine_ch07")


def test_unfinished_code_writes_nothing_and_says_nothing(folder, capsys):
    stub = cell("def choose_victim(running):\n    raise NotImplementedError()\n")
    ch07.check_choose_victim(stub["choose_victim"])
    assert capsys.readouterr().out.startswith("⏳ [07.2]") and not folder.exists()


def test_the_verdict_is_the_same_with_saving_on_or_off(folder, capsys, monkeypatch):
    """Saving only adds a note under the verdict; code it cannot save keeps its ✅."""
    fn = cell("ORDER = [2, 1]\n\ndef choose_victim(running):\n"
              "    return running[len(running) - 1]\n")["choose_victim"]
    ch07.check_choose_victim(fn)
    first = capsys.readouterr().out.splitlines()[0]
    monkeypatch.setenv(mine.ENV, "off")
    ch07.check_choose_victim(fn)
    assert capsys.readouterr().out.splitlines() == [first]
    odd = cell("SEEN = []\n\ndef choose_victim(running):\n    SEEN.append(1)\n"
               "    return running[-1]\n")["choose_victim"]
    monkeypatch.setenv(mine.ENV, str(folder))
    ch07.check_choose_victim(odd)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == first and "not saved: it uses `SEEN`, a list" in out[1]


def test_code_from_files_and_other_folders_is_not_saved(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(mine.ENV, raising=False)
    for name, expected in (("exercises", tmp_path / "mine"), ("solutions", None),
                           ("notebooks", None)):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        assert mine.save_folder() == expected
    monkeypatch.chdir(tmp_path / "exercises")

    def choose_victim(running):  # defined in this file, not in a notebook cell
        return running[-1]

    ch07.check_choose_victim(choose_victim)
    assert capsys.readouterr().out.startswith("✅") and not (tmp_path / "mine").exists()


def test_a_section_is_replaced_and_the_others_stay(folder):
    mine.save("06.3", cell("def can_admit(a, b, c, budget):\n    return True\n")["can_admit"],
              folder)
    mine.save("06.1", cell("def build_metadata(t, s, q, b):\n    return 1\n")["build_metadata"],
              folder)
    mine.save("06.1", cell("def build_metadata(t, s, q, b):\n    return 2\n")["build_metadata"],
              folder)
    assert mine.saved(folder) == ["06.1", "06.3"]
    assert mine.load("06.1", folder)(0, 0, 0, 0) == 2 and mine.load("06.3", folder)(0, 0, 0, 0)
    assert mine.load("06.2", folder) is None
    assert (folder / "__init__.py").exists()  # `from mine.ch06 import ...` from the root


def test_a_broken_saved_file_is_an_import_error_naming_it(folder):
    mine.save("06.3", cell("def can_admit(a, b, c, budget):\n    return True\n")["can_admit"],
              folder)
    path = folder / "ch06.py"
    path.write_text(path.read_text().replace("return True", "return undefined_name"))
    assert mine.load("06.3", folder) is not None  # a name error only when called
    path.write_text(path.read_text() + "\n1 / 0\n")
    with pytest.raises(ImportError, match="ch06.py does not import"):
        mine.load("06.3", folder)


CHECKS = {"03.1": ch03.check_append_token, "03.2": ch03.check_fork,
          "03.3": ch03.check_free_block, "05.5": ch05.check_paged_decode_kernel,
          "05.6": ch05.check_slot_mapping, "06.1": ch06.check_build_metadata,
          "06.2": ch06.check_num_required_blocks, "06.3": ch06.check_can_admit,
          "06.4": ch06.check_schedule_waiting,
          "07.1": ch07.check_swap_mapping, "07.2": ch07.check_choose_victim,
          "07.3": ch07.check_preempt_until_fits,
          "08.2": ch08.check_beam_step, "10.1": ch10.check_block_hashes,
          "10.2": ch10.check_longest_cache_hit, "10.3": ch10.check_free_queue,
          "10.4": ch10.check_allocate_slots, "11.3": ch11.check_write_int8_blocks,
          "11.4": ch11.check_drop_oldest, "12.3": ch12.check_rank_attention}


@pytest.fixture(scope="module")
def solutions_saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("solutions") / "mine"
    return folder, mine.save_solutions(folder)


def test_every_piece_of_the_solutions_is_saved_and_passes_from_its_file(solutions_saved,
                                                                         capsys):
    """The saved files stand alone: imported from mine/, each piece passes its check
    again (the Triton kernel too: it is read back from its file)."""
    folder, done = solutions_saved
    assert sorted(done) == sorted(SAVED) == sorted(CHECKS)
    assert mine.saved(folder) == sorted(SAVED)
    for ex_id, check in CHECKS.items():
        piece = mine.load(ex_id, folder)
        assert piece is not None, ex_id
        with grading.record_verdicts() as verdicts:
            check(piece)
        assert [v[:2] for v in verdicts] == [("✅", ex_id)], (ex_id, capsys.readouterr().out)
    assert "@triton.jit" in (folder / "ch05.py").read_text()


def test_a_notebook_cell_is_saved_through_ipython_linecache(tmp_path):
    """A real kernel: inspect.getsource reads the cell, the check cell saves the piece
    and says where, next to exercises/ as a learner's checkout has it."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "import inspect\nimport paged_lib\nfrom paged_lib.course.grading import ch07",
        RIGHT.replace("my_victim", "choose_victim"),
        "print(inspect.getsource(choose_victim).splitlines()[0])",
        "ch07.check_choose_victim(choose_victim)")]
    (tmp_path / "exercises").mkdir()
    path = tmp_path / "exercises" / "07_x.ipynb"
    nbformat.write(nb, path)
    ran = notebooks.execute(path, timeout=120)
    texts = ["".join(o.get("text", "") for o in c.outputs) for c in ran.cells]
    assert texts[2] == "def choose_victim(running: list[SequenceGroup]) -> SequenceGroup:\n"
    assert texts[3].startswith("✅ [07.2]") and "saved to mine/ch07.py" in texts[3]
    victim = mine.load("07.2", Path(tmp_path / "mine"))
    assert victim([1, 2, 3]) == 3
    line = mine.share_line(mine.save_folder_for(tmp_path / "exercises"))  # make grade's line
    assert line.startswith(f"Your engine (chapter 13): 1 of {len(SAVED)} pieces are yours")
    assert "still the library's: 03.1 append_token," in line and "07.2" not in line
