"""Prefix-heavy workloads, and the hash-chain vs radix-tree replay over them: hand-checked
hits, equal hits at equal granularity when nothing is evicted, no leaked slots or blocks,
and the cache-aware scheduling demo's starvation and its fix."""

from __future__ import annotations

import inspect

import pytest

from paged_lib.studies import radix_tree
from paged_lib.studies.prefix_compare import (
    HashChainCache,
    RadixCache,
    code_size,
    compare,
    format_rows,
    format_schedule,
    replay,
    schedule,
    schedule_demo,
)
from paged_lib.studies.prefix_workloads import (
    PREFIX_WORKLOADS,
    PrefixRequest,
    few_shot,
    multi_turn_chat,
    no_sharing,
    prompt_tokens,
    shared_prefix_bound,
    shared_system_prompt,
    two_prompt_burst,
)


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------- the workloads


@pytest.mark.parametrize("name", sorted(PREFIX_WORKLOADS))
def test_workloads_are_seeded_token_ids_of_a_few_hundred_tokens(name):
    make = PREFIX_WORKLOADS[name]
    a, b, c = make(seed=0), make(seed=0), make(seed=1)
    assert a == b and a != c and len(a) == 16
    for r in a:
        assert all(isinstance(t, int) and 0 <= t < 256 for t in r.prompt + r.output)
        assert 1 <= len(r.prompt) <= 400 and r.output_len == len(r.output) >= 1


def test_shared_system_prompt_shares_exactly_the_system_prompt():
    reqs = shared_system_prompt(num_requests=5, system_len=30, question_len=(5, 9),
                                output_len=(2, 3), seed=3)
    assert all(r.prompt[:30] == reqs[0].prompt[:30] for r in reqs)
    assert all(35 <= len(r.prompt) <= 39 and 2 <= r.output_len <= 3 for r in reqs)
    assert shared_prefix_bound(reqs) >= 4 * 30


def test_multi_turn_chat_resends_the_history_with_the_answers_interleaved():
    reqs = multi_turn_chat(num_conversations=3, num_turns=3, user_len=(4, 6),
                           output_len=(2, 5), system_len=7, seed=2)
    assert len(reqs) == 9
    for k in range(3, 9):  # turn t of conversation c is at t * 3 + c
        before = reqs[k - 3]
        assert reqs[k].prompt[:len(before.prompt) + before.output_len] == \
            before.prompt + before.output
        assert 4 <= len(reqs[k].prompt) - len(before.prompt) - before.output_len <= 6
    assert all(r.prompt[:7] == reqs[0].prompt[:7] for r in reqs)  # the system prompt
    assert common_prefix(reqs[0].prompt[7:], reqs[1].prompt[7:]) < 4  # different chats


def test_few_shot_shares_the_examples_then_varies_the_query():
    reqs = few_shot(num_requests=6, num_examples=3, example_len=(5, 5), query_len=(4, 8),
                    seed=1)
    assert all(r.prompt[:15] == reqs[0].prompt[:15] for r in reqs)
    assert all(19 <= len(r.prompt) <= 23 for r in reqs)


def test_no_sharing_gives_every_prompt_its_own_first_token():
    reqs = no_sharing(num_requests=40, seed=5)
    assert len({r.prompt[0] for r in reqs}) == 40 and shared_prefix_bound(reqs) == 0


def test_shared_prefix_bound_by_hand():
    reqs = [PrefixRequest([1, 2, 3], [4, 5]), PrefixRequest([1, 2, 3, 4, 9], [0]),
            PrefixRequest([1, 2], [7])]
    # second: 4 tokens shared with 1,2,3,4,5; third: 1 (the last prompt token is computed)
    assert shared_prefix_bound(reqs) == 0 + 4 + 1 and prompt_tokens(reqs) == 10


def test_two_prompt_burst_is_two_groups_and_one_outsider():
    timed = two_prompt_burst(burst_steps=5, system_len=10, question_len=(2, 3))
    groups = [t.group for t in timed]
    assert groups.count("A") == groups.count("B") == 5 and groups.count("outsider") == 1
    assert [t.arrival for t in timed if t.group == "A"] == [0, 1, 2, 3, 4]
    outsider = next(t.request for t in timed if t.group == "outsider")
    assert all(t.request.prompt[0] != outsider.prompt[0] for t in timed if t.group != "outsider")


@pytest.mark.parametrize("call, match", [
    (lambda: shared_system_prompt(num_requests=-1), "num_requests"),
    (lambda: shared_system_prompt(question_len=(5, 2)), "question_len"),
    (lambda: multi_turn_chat(user_len=(0, 3)), "user_len"),
    (lambda: few_shot(vocab_size=1), "vocab_size"),
    (lambda: no_sharing(num_requests=300), "at most"),
    (lambda: two_prompt_burst(burst_steps=0), "burst_steps"),
])
def test_bad_workload_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- the replay


def assert_no_leaks(cache):
    """Nothing held after the last request; every slot free or cached exactly once."""
    assert cache.in_use_tokens() == 0
    if isinstance(cache, HashChainCache):
        alloc = cache.allocator
        assert alloc.num_free == alloc.num_blocks and all(c == 0 for c in alloc.ref_counts)
        assert sorted(alloc.free_block_queue) == list(range(alloc.num_blocks))
    else:
        p, tree = cache.page_size, cache.tree
        assert tree.protected_size() == 0
        tree_pages = [s // p for n in tree._nodes() for s in n.value[::p]]
        assert sorted(tree_pages + cache.free_pages) == list(range(cache.num_pages))


def two_prompts_sharing_ten():
    shared = list(range(100, 110))
    return [PrefixRequest(shared + [1, 2, 3, 4, 5, 6], [7, 8]),
            PrefixRequest(shared + [9, 9, 9, 9, 9, 9], [7, 8])]


@pytest.mark.parametrize("make, hit", [
    (lambda: HashChainCache(16, 4), 8),
    (lambda: RadixCache(64, page_size=1), 10),
    (lambda: RadixCache(64, page_size=4), 8),
])
def test_two_prompts_sharing_ten_tokens_at_block_size_four(make, hit):
    cache = make()
    stats = replay(two_prompts_sharing_ten(), cache)
    assert stats.hits == [0, hit] and stats.hit_tokens == hit and stats.prompt_tokens == 32
    assert stats.prefill_tokens == 32 - hit and stats.evicted_tokens == 0
    assert_no_leaks(cache)


@pytest.mark.parametrize("make, hit", [
    (lambda: HashChainCache(16, 4), 4),
    (lambda: RadixCache(64, page_size=1), 7),
    (lambda: RadixCache(64, page_size=4), 4),
])
def test_the_last_prompt_token_is_always_computed(make, hit):
    cache = make()
    stats = replay([PrefixRequest(list(range(8)), [50])] * 2, cache)
    assert stats.hits == [0, hit]
    assert_no_leaks(cache)


@pytest.mark.parametrize("make", [lambda: HashChainCache(16, 4),
                                  lambda: RadixCache(64, 1), lambda: RadixCache(64, 4)])
def test_the_answer_is_cached_so_the_next_turn_hits_the_whole_history(make):
    first = PrefixRequest(list(range(10)), [20, 21, 22, 23, 24, 25])
    second = PrefixRequest(first.prompt + first.output + [30, 31, 32, 33, 34], [1])
    cache = make()
    assert replay([first, second], cache).hits == [0, 16]
    assert_no_leaks(cache)


def test_under_pressure_the_caches_evict_and_still_leak_nothing():
    reqs = no_sharing(num_requests=12, prompt_len=(20, 40), output_len=(4, 8), seed=2)
    for cache in (HashChainCache(8, 8), RadixCache(64, 8), RadixCache(64, 1)):
        stats = replay(reqs, cache)
        assert stats.hit_tokens == 0 and stats.evicted_tokens > 0
        assert stats.peak_held_tokens <= 64
        assert_no_leaks(cache)


@pytest.mark.parametrize("make, evicted", [
    (lambda: HashChainCache(4, 4), 12),  # 1 block for the first b, 1 for the second, and
    (lambda: RadixCache(16, 4), 16),     # 1 for the last a; the tree drops whole nodes: 8 + 8
])
def test_a_full_pool_keeps_the_recent_prompt_and_evicts_the_old_one(make, evicted):
    a = PrefixRequest(list(range(1, 9)) + [0], [0])      # 10 tokens: 3 blocks of 4
    b = PrefixRequest(list(range(11, 19)) + [0], [0])
    cache = make()
    stats = replay([a, b, b, a], cache)
    assert stats.hits == [0, 0, 8, 0] and stats.evicted_tokens == evicted  # b pushed a out
    assert_no_leaks(cache)


@pytest.mark.parametrize("name", sorted(PREFIX_WORKLOADS))
def test_equal_granularity_and_ample_memory_give_equal_hits(name):
    reqs = PREFIX_WORKLOADS[name]()
    hash_chain = replay(reqs, HashChainCache(512, 16))
    radix = replay(reqs, RadixCache(512 * 16, 16))
    fine = replay(reqs, RadixCache(512 * 16, 1))
    assert hash_chain.hits == radix.hits and hash_chain.evicted_tokens == 0
    assert fine.hit_tokens == shared_prefix_bound(reqs)  # page 1: every shared token
    assert all(f - 16 < h <= f for f, h in zip(fine.hits, radix.hits, strict=True))


def test_compare_defaults_replay_every_workload_on_three_caches_without_leaks():
    rows = compare()
    assert len(rows) == 3 * len(PREFIX_WORKLOADS)
    by = {(name, s.name): s for name, s in rows}
    for name in PREFIX_WORKLOADS:
        assert by[(name, "radix tree, page 1")].hit_tokens >= \
            by[(name, "radix tree, page 16")].hit_tokens
        assert all(s.peak_held_tokens <= 64 * 16 for (n, _), s in by.items() if n == name)
    assert by[("no-sharing", "hash chain, block 16")].hit_rate == 0.0
    assert by[("system-prompt", "hash chain, block 16")].hit_rate > 0.5
    assert len(format_rows(rows).splitlines()) == len(rows) + 1


def test_bad_cache_arguments_raise_value_error():
    with pytest.raises(ValueError, match="block_size"):
        HashChainCache(4, 0)
    with pytest.raises(ValueError, match="holds no page"):
        RadixCache(3, page_size=4)
    big = PrefixRequest(list(range(40)), [1])
    for cache in (HashChainCache(4, 4), RadixCache(16, 4)):
        with pytest.raises(ValueError, match="the pool has"):
            cache.serve(big)
        assert_no_leaks(cache)


def test_code_size_counts_both_modules():
    sizes = code_size()
    assert sizes["radix_tree"]["lines"] == len(inspect.getsource(radix_tree).splitlines())
    for s in sizes.values():
        assert 0 < s["code"] < s["lines"]


# ---------------------------------------------------------------- cache-aware scheduling


def test_longest_prefix_first_raises_hits_and_starves_the_outsider():
    fcfs, lpm, aging = schedule_demo(capacity_tokens=128, max_wait=8)
    assert (fcfs.policy, lpm.policy, aging.policy) == ("fcfs", "lpm", "lpm+aging")
    assert fcfs.hit_rate < aging.hit_rate < lpm.hit_rate  # the cache holds A or B, not both
    assert fcfs.outsider_wait <= 2 and lpm.outsider_wait == lpm.max_wait  # served last
    assert lpm.order[-1] == 2  # the outsider is the third request given
    assert 8 <= aging.outsider_wait < lpm.outsider_wait
    # the measured numbers (seed 0), for the chapter's prose
    assert [r.outsider_wait for r in (fcfs, lpm, aging)] == [2, 48, 9]
    assert [f"{r.hit_rate:.1%}" for r in (fcfs, lpm, aging)] == ["0.0%", "78.8%", "22.2%"]
    assert fcfs.mean_wait == lpm.mean_wait == aging.mean_wait  # one request per step
    assert len(format_schedule([fcfs, lpm, aging]).splitlines()) == 4


def test_schedule_on_a_tiny_case_by_hand():
    a1, a2 = PrefixRequest([1, 2, 3, 4, 5], [6]), PrefixRequest([1, 2, 3, 4, 7], [8])
    loner = PrefixRequest([9, 9, 9, 9, 9], [9])
    from paged_lib.studies.prefix_workloads import TimedRequest
    timed = [TimedRequest(0, a1, "A"), TimedRequest(0, loner, "outsider"),
             TimedRequest(1, a2, "A")]
    lpm = schedule(timed, RadixCache(12, 1), "lpm")
    assert lpm.order == [0, 2, 1] and lpm.waits == [0, 2, 0] and lpm.outsider_wait == 2
    assert schedule(timed, HashChainCache(4, 2), "lpm").order == [0, 2, 1]  # hits 4 of 5
    fcfs = schedule(timed, RadixCache(12, 1), "fcfs")
    assert fcfs.order == [0, 1, 2] and fcfs.waits == [0, 1, 1]
    aging = schedule(timed, RadixCache(12, 1), "lpm+aging", max_wait=1)
    assert aging.order == [0, 1, 2]
    with pytest.raises(ValueError, match="policy"):
        schedule(timed, RadixCache(12, 1), "sjf")
    with pytest.raises(ValueError, match="max_wait"):
        schedule(timed, RadixCache(12, 1), "lpm+aging", max_wait=-1)
