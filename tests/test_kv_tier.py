"""The CPU tier simulation (chapter 11): LRU and CLOCK by hand, invariants on a chat trace."""

import pytest

from paged_lib.studies.kv_tier import Clock, chat_trace, compare_policies, simulate

# The textbook reference string on 3 frames: LRU faults 10 times, CLOCK (second chance,
# bit set on load and on use) 9 times; 5 of the faults are first uses.
REFERENCE = [[p] for p in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]


@pytest.mark.parametrize("policy, hits, misses", [("lru", 2, 5), ("clock", 3, 4)])
def test_reference_string_without_a_cpu_tier(policy, hits, misses):
    s = simulate(REFERENCE, gpu_blocks=3, cpu_blocks=0, policy=policy)
    assert (s.gpu_hits, s.misses, s.new, s.reused) == (hits, misses, 5, 7)
    assert s.dropped == hits + misses + 5 - 3 - hits  # every fault after the first 3 evicts
    assert s.bytes_moved == 0 and s.cpu_hits == 0


def test_clock_second_chance_by_hand():
    c = Clock(3)
    for k in "abc":
        c.insert(k)
    c.touch("a")
    assert c.victim(set()) == "a"  # every bit set: one sweep clears them, 'a' goes first
    c.remove("a")
    c.insert("d")  # into a's frame, bit set; the hand is past it, at 'b' (bit clear)
    c.touch("b")
    assert c.victim(set()) == "c"  # b gets its second chance
    assert c.victim({"d"}) == "b"  # d pinned; b's bit was cleared on the last sweep


@pytest.mark.parametrize("policy", ["lru", "clock"])
def test_waiting_blocks_go_to_cpu_and_come_back(policy):
    s = simulate([[1], [2], [3], [1]], gpu_blocks=2, cpu_blocks=1, policy=policy,
                 block_bytes=100)
    # 3 pushes 1 out to the CPU; 1 comes back and pushes 2 out
    assert (s.blocks_to_cpu, s.blocks_to_gpu, s.cpu_hits, s.misses) == (2, 1, 1, 0)
    assert s.bytes_moved == 300 and s.hit_rate == 1.0 and s.gpu_hit_rate == 0.0


def test_a_full_cpu_tier_drops_its_own_victim():
    s = simulate([[1], [2], [3], [2], [1]], gpu_blocks=1, cpu_blocks=1, policy="lru")
    # 1 frame each: 2 pushes 1 to the CPU; 3 pushes 2 there, which drops 1; 2 comes back
    # (3 goes to the CPU); 1 was dropped: a miss, and 2 pushed out drops 3
    assert (s.dropped, s.misses, s.cpu_hits, s.blocks_to_cpu) == (2, 1, 1, 4)


@pytest.fixture(scope="module")
def trace():
    return chat_trace(block_size=16, num_conversations=6, num_turns=5, system_len=40, seed=1)


@pytest.mark.parametrize("gpu, cpu", [(30, 0), (30, 20), (40, 200), (60, 5)])
def test_invariants_on_a_chat_trace(trace, gpu, cpu):
    reads = sum(len(set(r)) for r in trace)
    for s in compare_policies(trace, gpu, cpu, block_bytes=4096).values():
        assert s.peak_gpu <= gpu and s.peak_cpu <= cpu
        assert s.bytes_moved == (s.blocks_to_cpu + s.blocks_to_gpu) * 4096
        assert s.gpu_hits + s.cpu_hits + s.misses == s.reused == reads - s.new
        assert s.blocks_to_gpu == s.cpu_hits and s.requests == len(trace)
        if gpu + cpu >= len({b for r in trace for b in r}):
            assert s.misses == 0 and s.dropped == 0  # room for everything: nothing lost
        assert s == simulate(trace, gpu, cpu, s.policy, 4096)  # deterministic


def test_a_cpu_tier_turns_misses_into_copies(trace):
    alone = simulate(trace, 30, 0, "lru")
    tiered = simulate(trace, 30, 200, "lru")
    assert alone.misses > 0 and tiered.misses == 0
    assert tiered.cpu_hits == alone.misses + alone.gpu_hits - tiered.gpu_hits


def test_random_order_keeps_each_conversation_in_order():
    rr = chat_trace(block_size=8, num_conversations=3, num_turns=4, seed=2)
    rand = chat_trace(block_size=8, order="random", num_conversations=3, num_turns=4, seed=2)
    assert sorted(map(tuple, rand)) == sorted(map(tuple, rr)) and rand != rr
    for c in range(3):  # a conversation's turns grow: each one's blocks start with the last's
        mine = [t for t in rand if t[:1] == rr[c][:1]]
        assert mine == rr[c::3]
    with pytest.raises(ValueError, match="order must be"):
        chat_trace(order="lifo")


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "fifo"}, "policy must be one of"),
    ({"gpu_blocks": 0}, "gpu_blocks must be an int >= 1"),
    ({"cpu_blocks": -1}, "cpu_blocks must be an int >= 0"),
    ({"gpu_blocks": 2}, "request 0 needs 3 blocks"),
])
def test_bad_input_is_a_value_error(kwargs, match):
    args = {"gpu_blocks": 4, "cpu_blocks": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        simulate([[1, 2, 3]], **args)
