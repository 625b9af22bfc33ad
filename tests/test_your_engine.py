"""Chapter 13: an engine from the learner's saved pieces.

With every solution saved, every piece is the learner's and the tokens equal
transformers' and the library engine's; with nothing saved the library runs and says
so; a broken piece saved is named.
"""

from types import SimpleNamespace

import pytest

from paged_lib.blocks import BlockTable
from paged_lib.course import mine
from paged_lib.course.demos import your_engine
from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.hooks import EngineHooks
from paged_lib.model import load_tiny_code_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return load_tiny_code_llama()


@pytest.fixture(scope="module")
def hf():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(TINY_CODE_LLAMA_DIR).float().eval()


@pytest.fixture(scope="module")
def solutions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sol") / "mine"
    mine.save_solutions(folder)
    return folder


def test_the_solutions_make_an_engine_of_yours_equal_to_transformers(model, hf, solutions,
                                                                      capsys):
    pieces, parts = your_engine.gather(solutions)
    assert all(p.yours for p in parts) and sorted(pieces) == sorted(mine.PIECES)
    n = len(mine.PIECES)
    assert your_engine.summary(parts) == f"{n} of {n} pieces of the engine are yours"
    assert your_engine.check(model, hf, pieces, parts)
    out = capsys.readouterr().out
    assert out.count("tokens equal the library engine's: True, and transformers' (") == 2
    assert out.count("the same schedule: True") == 2 and "❌" not in out
    _, stats = your_engine.serve(model, pieces)  # the workload does what it says
    assert stats.preemptions > 0 and stats.swapped_blocks > 0
    assert stats.prefix_cache_hit_tokens > 0


def test_nothing_saved_runs_the_library_and_says_so(model, hf, tmp_path, capsys):
    pieces, parts = your_engine.gather(tmp_path / "mine")
    assert pieces == {} and not any(p.yours for p in parts)
    assert all("not passed yet" in p.line() and "library" in p.line() for p in parts)
    assert your_engine.check(model, hf, pieces, parts)
    assert "❌" not in capsys.readouterr().out


@pytest.mark.parametrize("ex_id, old, new, what", [
    ("03.1", "elif table.allocator.refcount(table._blocks[-1]) > 1:", "elif False:",
     "raised ValueError"),                            # no copy-on-write: caught
    ("06.1", "block * block_size + pos % block_size",
     "block * block_size + (pos + 1) % block_size", ""),  # the next token's slot
    ("08.2", "scored.sort(key=lambda c: (-c[0], c[1], c[2]))",
     "scored.sort(key=lambda c: (c[0], c[1], c[2]))", "changed the generated tokens"),
    # the worst beams kept
])
def test_a_broken_piece_is_named(model, hf, solutions, tmp_path, capsys, ex_id, old, new,
                                 what):
    broken = tmp_path / "mine"
    broken.mkdir()
    for path in solutions.iterdir():
        text = path.read_text()
        if path.name == f"ch{ex_id[:2]}.py":
            assert old in text
            text = text.replace(old, new)
        (broken / path.name).write_text(text)
    pieces, parts = your_engine.gather(broken)
    assert not your_engine.check(model, hf, pieces, parts)
    bad = [line for line in capsys.readouterr().out.splitlines() if "❌" in line]
    assert bad and all(f"your {ex_id} " in line for line in bad), bad
    assert what in bad[0]


def test_a_saved_file_that_does_not_import_falls_back_to_the_library(solutions, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "ch06.py").write_text((solutions / "ch06.py").read_text() + "\n1 / 0\n")
    pieces, parts = your_engine.gather(folder)
    part = next(p for p in parts if p.ex_id == "06.1")
    assert "06.1" not in pieces and not part.yours and "does not import" in part.note


def test_the_block_table_hook_is_checked_and_used(model):
    with pytest.raises(ValueError, match="the BlockTable hook must be BlockTable or a subclass"):
        BlockManager(4, 4, hooks=SimpleNamespace(BlockTable=dict, FreeBlockQueue=None))
    made = []

    class Counting(BlockTable):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    with pytest.raises(ValueError, match="EngineHooks.BlockTable must be BlockTable"):
        LLMEngine(model, 16, 4, hooks=EngineHooks(BlockTable=object))
    engine = LLMEngine(model, 16, 4, hooks=EngineHooks(BlockTable=Counting))
    got = engine.generate([[256, 100, 101]],
                          SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=0))
    want = LLMEngine(model, 16, 4).generate([[256, 100, 101]],
                                            SamplingParams(max_tokens=6, temperature=1.0, n=2,
                                                           seed=0))
    assert made and all(isinstance(s, Counting) for s in made)
    assert [c.token_ids for c in got[0].outputs] == [c.token_ids for c in want[0].outputs]


def test_the_learners_kernel_computes_the_decode_attention(model, solutions):
    kernel = mine.load("05.5", solutions)
    launches = []

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    workload = your_engine.kernel_workload()
    got = your_engine.serve(model, {}, workload, Spy())
    want = your_engine.serve(model, {}, workload)
    assert your_engine.token_ids(got[0]) == your_engine.token_ids(want[0])
    decodes = sum(kind == "decode" for kind in got[1].step_kinds)
    assert decodes > 0 and len(launches) == decodes * model.config.num_layers
    assert set(launches) == {(2, model.config.num_kv_heads)}


def test_the_fork_workflow_runs_chapter_13_on_mine(solutions, monkeypatch, capsys):
    monkeypatch.setenv(mine.ENV, str(solutions))
    assert your_engine.main() == 0
    out = capsys.readouterr().out
    assert f"{len(mine.PIECES)} of {len(mine.PIECES)} pieces of the engine are yours" in out
    assert out.count("tokens equal the library engine's: True") == 2
