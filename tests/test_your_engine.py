"""Chapter 13: an engine from the learner's saved pieces, serving SmolLM2.

With every solution saved, every piece passes its scenarios and the engine of all of them
answers the chat workload on SmolLM2-135M-Instruct with the library engine's tokens and
schedule and transformers' tokens; with nothing saved the library runs and says so; a
broken piece among the solutions is the one named (tests/test_your_engine_blame.py names
each piece alone). The learner's Triton kernel computes the decode attention of the tiny
model's scenario and of one real layer.
"""

from types import SimpleNamespace

import pytest
import torch
from conftest import needs_smollm2

from paged_lib.blocks import BlockTable
from paged_lib.course import mine
from paged_lib.course.demos import your_engine, your_engine_check, your_engine_scenarios
from paged_lib.course.exercises import SAVED
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.hooks import EngineHooks
from paged_lib.model import load_tiny_code_llama
from paged_lib.models import smollm2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return load_tiny_code_llama()


@pytest.fixture(scope="module")
def solutions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sol") / "mine"
    mine.save_solutions(folder)
    return folder


def test_the_solutions_pass_every_scenario(solutions, capsys):
    pieces, parts = your_engine.gather(solutions)
    assert all(p.yours for p in parts) and sorted(pieces) == sorted(SAVED)
    n = len(SAVED)
    assert your_engine.summary(parts) == f"{n} of {n} pieces of the engine are yours"
    verdicts = your_engine_scenarios.check_pieces(pieces)
    assert [v for v in verdicts if v[1] is not None] == []
    out = capsys.readouterr().out
    assert out.count("✅ your ") == n and "❌" not in out


def test_the_scenarios_reach_the_states_they_are_named_for():
    def total(key, field):
        return sum(len(s[field]) if isinstance(s[field], list) else s[field]
                   for s in your_engine_scenarios.library(key).steps)

    assert total("swap", "swapped out") > 0 and total("swap", "preempted") > 0
    assert total("recompute", "preempted") >= 2 and total("recompute", "swapped out") == 0
    assert total("samples", "copied") > 0 and total("beam ties", "copied") > 0
    assert total("prefix", "prefix-cache hit tokens") > 0
    assert total("eviction", "prefix-cache hit tokens") > 0
    assert total("hit at the head", "prefix-cache hit tokens") == 8
    chunked = your_engine_scenarios.library("chunked").steps
    assert max(sum(e[2] for e in s["ran"]) for s in chunked) == 8  # the budget, met
    admission = your_engine_scenarios.library("admission").steps
    assert max(len(s["ran"]) for s in admission) == 4  # the sequence limit, met
    # beams tie: the tied model gives tokens 101, 120 and 121 one logit, the highest
    tied = your_engine_scenarios.tied_model().lm_head.weight
    assert torch.equal(tied[101], tied[120]) and torch.equal(tied[101], tied[121])
    tokens = your_engine_scenarios.library("beam ties").tokens
    assert {t for beams in tokens for beam in beams for t in beam} & {101, 120, 121}


def test_nothing_saved_runs_the_library_and_says_so(tmp_path, capsys):
    pieces, parts = your_engine.gather(tmp_path / "mine")
    assert pieces == {} and not any(p.line().startswith("yours") for p in parts)
    assert all("not passed yet" in p.line() and "library" in p.line() for p in parts)
    assert your_engine_scenarios.check_pieces(pieces) == []
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("ex_id, old, new", [
    ("06.1", "block * block_size + pos % block_size",
     "block * block_size + (pos + 1) % block_size"),  # the next token's slot
    ("08.2", "scored.sort(key=lambda c: (-c[0], c[1], c[2]))",
     "scored.sort(key=lambda c: (c[0], c[1], c[2]))"),  # the worst beams kept
])
def test_a_broken_piece_among_the_solutions_is_the_one_named(solutions, tmp_path, capsys,
                                                             ex_id, old, new):
    broken = tmp_path / "mine"
    broken.mkdir()
    for path in solutions.iterdir():
        text = path.read_text()
        if path.name == f"ch{ex_id[:2]}.py":
            assert old in text
            text = text.replace(old, new)
        (broken / path.name).write_text(text)
    pieces, _ = your_engine.gather(broken)
    verdicts = your_engine_scenarios.check_pieces(pieces)
    assert [ex for ex, v in verdicts if v is not None] == [ex_id]
    bad = [line for line in capsys.readouterr().out.splitlines() if "❌" in line]
    assert len(bad) == 1 and bad[0].startswith(f"❌ your {ex_id} ")


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

    scenario = your_engine_scenarios.SCENARIOS["decode kernel"]
    got = your_engine_scenarios.serve(scenario, {}, Spy())
    want = your_engine_scenarios.library("decode kernel")
    assert got.tokens == want.tokens and got.steps == want.steps
    decodes = your_engine_check.decode_steps(got.steps)
    assert decodes > 0 and len(launches) == decodes * model.config.num_layers
    assert set(launches) == {(2, model.config.num_kv_heads)}


@pytest.mark.slow
@needs_smollm2
def test_the_solutions_engine_answers_chat_as_transformers_and_the_library(solutions, capsys):
    from transformers import LlamaForCausalLM

    real, tokenizer = smollm2.load()
    hf = LlamaForCausalLM.from_pretrained(smollm2.cache_folder(),
                                          dtype=torch.float32).eval()
    pieces, _ = your_engine.gather(solutions)
    kernel = pieces.pop("05.5")
    captured: dict = {}
    ok, outputs, steps = your_engine_check.check(real, tokenizer, hf, pieces, captured)
    out = capsys.readouterr().out
    assert ok and "❌" not in out, out
    assert "the library engine's tokens and schedule: True; transformers' tokens (4 " \
        "requests): True" in out
    assert sum(len(s["preempted"]) for s in steps) > 0  # the chat workload swaps
    assert sum(len(s["swapped out"]) for s in steps) > 0
    assert sum(s["prefix-cache hit tokens"] for s in steps) > 0
    assert outputs[0].outputs[0].text == outputs[5].outputs[0].text  # asked twice, greedy
    assert "Paris" in outputs[0].outputs[0].text
    # the learner's kernel on one real decode call: layer 0, 3 KV heads of 3 query heads each
    assert captured["q"].shape[1:] == (9, 64) and captured["k_cache"].shape[2] == 3
    error = your_engine_check.kernel_on_one_layer(kernel, captured).error
    assert error <= 1e-4


@pytest.mark.slow
@needs_smollm2
def test_the_fork_workflow_runs_chapter_13_on_mine(solutions, tmp_path, monkeypatch, capsys):
    """The notebook, run by ``main`` in a kernel of its own, on the solutions of chapters
    03, 05 and 12 (the table, the allocator, the kernel, the slot mapping, one rank's
    attention; every piece at once is test_the_solutions_pass_every_scenario's, in this
    process, where its verdicts are not served again)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in ("__init__.py", "ch03.py", "ch05.py", "ch12.py"):
        (folder / name).write_text((solutions / name).read_text())
    monkeypatch.setenv(mine.ENV, str(folder))
    assert your_engine.main() == 0
    out = capsys.readouterr().out
    yours = [ex for ex in SAVED if ex[:2] in ("03", "05", "12")]
    assert f"{len(yours)} of {len(SAVED)} pieces of the engine are yours" in out
    assert out.count("✅ your ") == len(yours)
    assert "the library engine's tokens and schedule: True; transformers' tokens" in out


@pytest.mark.slow
@needs_smollm2
def test_a_failing_piece_is_named_first_and_the_chat_runs_the_library_s(tmp_path, capsys):
    from transformers import LlamaForCausalLM

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "ch07.py").write_text(  # the oldest group first
        "# >>> 07.2 choose_victim: x\ndef choose_victim(running):\n    return running[0]\n"
        "# <<< 07.2\n")
    pieces, _ = your_engine.gather(folder)
    real, tokenizer = smollm2.load()
    hf = LlamaForCausalLM.from_pretrained(smollm2.cache_folder(),
                                          dtype=torch.float32).eval()
    ok, outputs, _ = your_engine_check.check(real, tokenizer, hf, pieces)
    lines = capsys.readouterr().out.splitlines()
    assert not ok and outputs is not None
    assert lines[0].startswith("❌ your 07.2 (preemption: which group to preempt) on recompute")
    assert lines[1] == "the chat workload runs the library's 07.2 in place of yours"
    assert lines[2].endswith("the library engine's tokens and schedule: True; transformers' "
                             "tokens (4 requests): True")
