"""Sliding window with attention sinks (chapter 11): paged_lib.engine.window in the engine.

The reference is independent of the engine: a dense model run that keeps every token's
key *before* RoPE, drops the oldest block of recent tokens with its own rule, and at each
step rotates the kept keys fresh at their cache positions (plain softmax attention, no
blocks). The engine stores rotated keys in blocks and re-rotates them when it drops one.
"""

import math

import pytest
import torch

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.scheduler_output import SchedulerOutput
from paged_lib.engine.sequence import Sequence, SequenceGroup
from paged_lib.engine.window import (
    SlidingWindow,
    drop_oldest,
    kept_tokens,
    num_dropped,
    window_blocks,
)
from paged_lib.model import apply_rope, rope_cos_sin
from paged_lib.studies.streaming import (
    held_out_stream,
    memory_curve,
    stream_bits_per_byte,
    stream_logprobs,
)
from paged_lib.tokenizer import BOS_ID, EOS_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 3, 88, 41, 9, 23, 60, 2, 71]


class DenseStream:
    """StreamingLLM without blocks: keys kept before RoPE, rotated fresh at each step."""

    def __init__(self, model, window, sinks, block_size):
        self.model, self.window, self.sinks, self.block_size = model, window, sinks, block_size
        self.kept = []  # keys/values of the tokens in the cache, in cache order
        self.keys = [[] for _ in model.layers]
        self.vals = [[] for _ in model.layers]

    @torch.no_grad()
    def feed(self, token):
        """Log-probabilities of the next token after feeding ``token``."""
        m, cfg = self.model, self.model.config
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        sinks, bs = self.sinks, self.block_size
        if len(self.kept) + 1 - min(sinks, len(self.kept)) >= self.window + bs:
            for lst in (self.kept, *self.keys, *self.vals):  # the oldest recent block leaves
                del lst[sinks:sinks + bs]
        self.kept.append(token)
        cos, sin = rope_cos_sin(torch.arange(len(self.kept)), d, cfg.rope_theta, m.dtype)
        x = m.embed_tokens(torch.tensor([token]))
        for layer, lk, lv in zip(m.layers, self.keys, self.vals, strict=True):
            a, y = layer.self_attn, layer.input_layernorm(x)
            q = apply_rope(a.q_proj(y).view(1, h, d), cos[-1:], sin[-1:])[0]
            lk.append(a.k_proj(y).view(kvh, d))
            lv.append(a.v_proj(y).view(kvh, d))
            k = apply_rope(torch.stack(lk), cos, sin).repeat_interleave(h // kvh, 1)
            v = torch.stack(lv).repeat_interleave(h // kvh, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) / math.sqrt(d), -1)
            x = x + a.o_proj(torch.einsum("hn,nhd->hd", p, v).reshape(1, h * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return torch.log_softmax(m.compute_logits(m.norm(x))[0], -1)


def dense_reference(model, prompt, max_tokens, window, sinks, block_size):
    """Greedy tokens after ``prompt`` and their logprobs, from :class:`DenseStream`."""
    stream = DenseStream(model, window, sinks, block_size)
    for t in prompt[:-1]:
        stream.feed(t)
    tok, out, logps = prompt[-1], [], []
    for _ in range(max_tokens):
        logp = stream.feed(tok)
        tok = int(logp.argmax())
        out.append(tok)
        logps.append(float(logp[tok]))
    return out, logps


def run(model, prompts, max_tokens, num_blocks=64, block_size=8, **kw):
    engine = LLMEngine(model, num_blocks, block_size=block_size, **kw)
    outs = engine.generate(prompts,
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    assert engine.block_manager.num_free_blocks == num_blocks, "blocks leaked"
    return [o.outputs[0] for o in outs], engine


def test_num_dropped_and_kept_tokens_by_hand():
    # window 8, 2 sinks, block 4: a block leaves when 12 recent tokens would be there
    assert [num_dropped(n, 8, 2, 4) for n in (13, 14, 17, 18, 21, 22)] == [0, 4, 4, 8, 8, 12]
    assert kept_tokens(14, 8, 2, 4) == [0, 1] + list(range(6, 14))
    assert kept_tokens(1, 8, 2, 4) == [0]
    assert window_blocks(17, 8, 2, 4) == 4 and window_blocks(18, 8, 2, 4) == 3


def test_drop_oldest_moves_sinks_and_frees_one_block():
    alloc = BlockAllocator(8)
    blocks = [alloc.allocate() for _ in range(3)]
    table = BlockTable(alloc, 4, blocks, 11)  # 2 sinks + 9 recent
    new, op = drop_oldest(table, 2)
    assert new.blocks == blocks[1:] and new.num_tokens == 7 and alloc.num_free == 6
    assert (op.copy_src, op.copy_dst, op.copy_len, op.shift) == (blocks[0], blocks[1], 2, 4)
    b1, b2 = blocks[1], blocks[2]  # the 5 recent tokens left: offsets 2, 3 of b1, 0-2 of b2
    assert op.rotate_slots == (b1 * 4 + 2, b1 * 4 + 3, b2 * 4, b2 * 4 + 1, b2 * 4 + 2)
    new2, op2 = drop_oldest(BlockTable(alloc, 4, [alloc.allocate() for _ in range(3)], 12), 4)
    assert op2.copy_len == 0 and new2.num_tokens == 8  # sinks fill their block: no copy
    with pytest.raises(ValueError, match="no 4 recent tokens"):
        drop_oldest(new, 4)
    new2.fork()
    with pytest.raises(ValueError, match="are shared"):
        drop_oldest(new2, 0)
    assert new2.num_tokens == 8 and alloc.num_free == 4  # unchanged by the refusal


def test_a_preempted_stream_that_dropped_tokens_is_a_runtime_error():
    w = SlidingWindow(8, 0, 4)
    seq = Sequence(0, list(range(12)))
    alloc = BlockAllocator(4)
    seq.block_table = BlockTable(alloc, 4)
    for _ in range(11):
        seq.block_table.append_token()
        seq.num_cached += 1
    w.slide(seq)
    group = SequenceGroup(7, [seq], SamplingParams(max_tokens=4, temperature=0.0))
    w.check_no_preemption(SchedulerOutput(step=0))
    with pytest.raises(RuntimeError, match="request 7 was preempted after its window dropped 4"):
        w.check_no_preemption(SchedulerOutput(step=0, preempted=[group]))


def test_window_larger_than_stream_equals_no_window(tiny_model):
    plain, _ = run(tiny_model, [PROMPT], 120)
    windowed, _ = run(tiny_model, [PROMPT], 120, sliding_window=200, num_sink_tokens=4)
    assert windowed[0].token_ids == plain[0].token_ids
    assert windowed[0].cumulative_logprob == plain[0].cumulative_logprob


@pytest.mark.parametrize("sinks", [0, 3, 8, 11])  # none, inside one block, whole, across
def test_windowed_tokens_equal_the_dense_reference(tiny_model, sinks):
    (got,), engine = run(tiny_model, [PROMPT], 100, num_blocks=12, sliding_window=16,
                         num_sink_tokens=sinks)
    want, logps = dense_reference(tiny_model, PROMPT, 100, 16, sinks, 8)
    assert got.token_ids == want
    assert abs(got.cumulative_logprob - sum(logps)) < 1e-3
    assert engine.stats.peak_blocks_used == engine.window.max_blocks


def test_streams_batched_on_a_tight_pool_wait_instead_of_being_preempted(tiny_model):
    prompts = [PROMPT, PROMPT[:4], [7] * 18]
    (a, b, c), engine = run(tiny_model, prompts, 60, num_blocks=9, sliding_window=16,
                            num_sink_tokens=2)
    assert engine.stats.preemptions == 0 and max(engine.stats.batch_sizes) == 2  # 4 + 4 < 9
    for prompt, got in zip(prompts, (a, b, c), strict=True):
        assert got.token_ids == dense_reference(tiny_model, prompt, 60, 16, 2, 8)[0]


def test_chunked_prefill_and_prefill_first_give_the_same_tokens(tiny_model):
    base, _ = run(tiny_model, [PROMPT * 2], 60, sliding_window=20, num_sink_tokens=1)
    for kw in ({"enable_chunked_prefill": True, "max_num_batched_tokens": 6,
                "max_num_seqs": 6},
               {"scheduling": "prefill_first"}):
        got, _ = run(tiny_model, [PROMPT * 2], 60, sliding_window=20, num_sink_tokens=1, **kw)
        assert got[0].token_ids == base[0].token_ids


def test_triton_backend_matches_torch(tiny_model):
    torch_out, _ = run(tiny_model, [PROMPT[:3]], 14, block_size=4, sliding_window=4,
                       num_sink_tokens=1)
    triton_out, _ = run(tiny_model, [PROMPT[:3]], 14, block_size=4, sliding_window=4,
                        num_sink_tokens=1, attention_backend="triton")
    assert triton_out[0].token_ids == torch_out[0].token_ids


@pytest.mark.parametrize("kw, match", [
    ({"sliding_window": 16, "enable_prefix_caching": True}, "enable_prefix_caching=True"),
    ({"sliding_window": 16, "preemption": "swap", "num_cpu_blocks": 4}, "preemption='swap'"),
    ({"sliding_window": 16, "kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'"),
    ({"num_sink_tokens": 4}, "needs sliding_window"),
    ({"sliding_window": 0}, "sliding_window must be an int >= 1"),
    ({"sliding_window": 16, "num_sink_tokens": -1}, "num_sink_tokens must be an int >= 0"),
    ({"sliding_window": 16.0}, "sliding_window must be an int"),
    ({"sliding_window": 250}, "max_position 256"),
])
def test_bad_options_are_value_errors(tiny_model, kw, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(tiny_model, 16, block_size=8, **kw)


@pytest.mark.parametrize("prompt, params, match", [
    (PROMPT, SamplingParams(max_tokens=4, n=2, temperature=1.0), "one sequence per request"),
    (PROMPT, SamplingParams(max_tokens=4, beam_width=2), "one sequence per request"),
    (list(range(21)), SamplingParams(max_tokens=4, temperature=0.0), "longer than num_sink_tokens"),
])
def test_requests_a_window_cannot_serve_are_value_errors(tiny_model, prompt, params, match):
    engine = LLMEngine(tiny_model, 16, block_size=8, sliding_window=16, num_sink_tokens=4)
    with pytest.raises(ValueError, match=match):
        engine.generate([prompt], params)
    assert engine.block_manager.num_free_blocks == 16


def test_stream_logprobs_equal_the_dense_reference_for_every_window(tiny_model):
    text = [(7 * i + 3) % 97 for i in range(70)]
    windows = [(None, 0), (16, 0), (16, 1), (16, 4), (100, 2)]
    got = stream_logprobs(tiny_model, text, windows, block_size=8)
    for row, (w, s) in zip(got, windows, strict=True):
        stream = DenseStream(tiny_model, w or 10**6, s, 8)
        want = torch.stack([stream.feed(a)[b] for a, b in zip(text, text[1:], strict=False)])
        torch.testing.assert_close(row, want, atol=1e-4, rtol=0)
    assert torch.equal(got[0], got[4])  # a window longer than the text changes nothing
    one_by_one = stream_logprobs(tiny_model, text, windows[2:4], block_size=8, max_chunk=1)
    torch.testing.assert_close(one_by_one, got[2:4], atol=1e-5, rtol=0)  # chunks change nothing
    bpb = stream_bits_per_byte(tiny_model, text, windows[:2], block_size=8)
    assert bpb == [pytest.approx(float(-r.mean() / math.log(2))) for r in got[:2]]


def test_held_out_stream_is_bos_then_held_out_files():
    ids = held_out_stream(3000)
    assert len(ids) == 3000 and ids[0] == BOS_ID
    assert all(0 <= t < 256 or t == EOS_ID for t in ids[1:])
    with pytest.raises(ValueError, match="num_tokens must be an int >= 2"):
        held_out_stream(1)


def test_memory_curve_flat_with_the_window_growing_without(tiny_model):
    curves = memory_curve(tiny_model, PROMPT, 120, sliding_window=16, num_sink_tokens=4,
                          block_size=8)
    tokens, full = curves["full"]
    assert tokens == list(range(len(PROMPT), len(PROMPT) + 120)) == curves["window"][0]
    assert full == [-(-n // 8) for n in tokens]  # every token kept
    assert curves["window"][1] == [window_blocks(n, 16, 4, 8) for n in tokens]
    assert max(curves["window"][1]) == -(-(4 + 16 + 7) // 8) == curves["window"][1][-1]
