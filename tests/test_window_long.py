"""Sliding window (chapter 11): a long stream's blocks stay flat (its own file: the
engine runs 2,000 steps, so it gets a test worker to itself)."""

import pytest

from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.window import window_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 3, 88, 41, 9, 23, 60, 2, 71]


def test_blocks_stay_flat_over_a_long_stream(tiny_model):
    engine = LLMEngine(tiny_model, 8, block_size=8, sliding_window=24, num_sink_tokens=4)
    (out,) = engine.generate([PROMPT],
                             SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 2000 and engine.stats.preemptions == 0
    assert engine.block_manager.num_free_blocks == 8, "blocks leaked"
    used = engine.stats.blocks_used  # after each step's allocations: num_tokens fed so far
    fed = [len(PROMPT)] + [len(PROMPT) + i for i in range(1, 2000)]
    assert used == [window_blocks(n, 24, 4, 8) for n in fed]
    assert max(used[:300]) == max(used) == engine.window.max_blocks == 5  # cdiv(4 + 24 + 7, 8)
