"""Orca-style reservation in the engine (chapter 14): paged_lib.engine.reservation.

Each policy serves the same requests as the paged engine, token for token; at every step
the free blocks cover what every running request may still take of its reservation (so
no reserved block goes to another request, and nobody is preempted); every block is
free at the end; and on a pool that memory limits, fewer requests run at once than paged.
"""

import random

import pytest

from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.reservation import RESERVATIONS, Reservation, reserved_tokens
from paged_lib.util import cdiv

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS, NUM_BLOCKS = 4, 40


def _requests(n=10, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(3, 20))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(2, 24), temperature=0.0, ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def test_reserved_tokens_are_chapter_02s():
    assert reserved_tokens("paged", 40, 25, 512) == 0
    assert reserved_tokens("orca-max", 40, 25, 512) == 512
    assert reserved_tokens("orca-pow2", 40, 25, 512) == 40 + 32
    assert reserved_tokens("orca-pow2", 40, 32, 512) == 40 + 32
    assert reserved_tokens("orca-pow2", 200, 300, 512) == 512  # at most max_len
    assert reserved_tokens("orca-oracle", 40, 25, 512) == 65
    assert Reservation("orca-pow2", 16, 512).blocks(40, 25) == cdiv(72, 16)
    with pytest.raises(ValueError, match="reservation must be one of"):
        reserved_tokens("orca", 1, 1, 512)


@pytest.fixture(scope="module")
def paged_run(tiny_model):
    prompts, params = _requests()
    engine = LLMEngine(tiny_model, NUM_BLOCKS, BS, attention_backend="torch", watermark=0.0,
                       max_model_len=64)
    outs = engine.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], max(engine.stats.batch_sizes)


@pytest.mark.parametrize("policy", RESERVATIONS[1:])
def test_reservation_serves_the_same_tokens_and_holds_its_blocks(tiny_model, paged_run, policy):
    prompts, params = _requests()
    checked = []

    def on_step(out, stats):
        running = engine.scheduler.running
        owed = engine.reservation.owed(running)
        assert engine.block_manager.num_free_blocks >= owed, "a reserved block was taken"
        for g in running:
            held = len(g.seqs[0].block_table.blocks)
            assert held <= engine.reservation.group_blocks(g)
        checked.append(len(running))

    engine = LLMEngine(tiny_model, NUM_BLOCKS, BS, attention_backend="torch", watermark=0.0,
                       max_model_len=64, reservation=policy, on_step=on_step)
    outs = engine.generate(prompts, params)
    tokens, paged_batch = paged_run
    assert [o.outputs[0].token_ids for o in outs] == tokens
    assert engine.stats.preemptions == 0
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    assert checked
    # memory limits the batch: fewer requests at once than paged on the same pool
    assert max(engine.stats.batch_sizes) < paged_batch


def test_reservation_rejects_what_it_cannot_serve(tiny_model):
    with pytest.raises(ValueError, match="does not combine with enable_prefix_caching"):
        LLMEngine(tiny_model, NUM_BLOCKS, BS, reservation="orca-max",
                  enable_prefix_caching=True)
    with pytest.raises(ValueError, match="reservation must be one of"):
        LLMEngine(tiny_model, NUM_BLOCKS, BS, reservation="orca")
    engine = LLMEngine(tiny_model, NUM_BLOCKS, BS, attention_backend="torch",
                       reservation="orca-oracle")
    with pytest.raises(ValueError, match="one sequence"):
        engine.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=4, temperature=1.0))
    # orca-max reserves max_model_len = 256 tokens = 64 blocks > 40: fails alone
    engine = LLMEngine(tiny_model, NUM_BLOCKS, BS, attention_backend="torch",
                       reservation="orca-max")
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert out[0].error is not None and "reserves 64 blocks" in out[0].error
