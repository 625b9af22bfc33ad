"""The engine's time split into parts (python -m paged_lib.bench.engine_parts).

Checked by what the accounting must satisfy on any machine, never by comparing durations:
which part runs inside which, how many calls each part gets, that the wrappers go away,
and (with a clock that ticks once per reading, so every "time" is a count) that a parent's
time holds its children's and its rest exactly.
"""

import itertools

import pytest
import torch
from conftest import needs_smollm2
from torch import nn

import paged_lib  # noqa: F401  # isort: split
from paged_lib import model as model_module
from paged_lib.bench import engine_parts
from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.llm import load_model
from paged_lib.kernels import cpu_layer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FORWARD, HEAD = ("model forward",), ("LM head",)


def serve_with_ticks(model, prompts, max_tokens):
    """Serve ``prompts`` with every part wrapped and both clocks replaced by counters
    that advance by one at each reading: the accounting's arithmetic, without time."""
    acc = engine_parts.defaultdict(lambda: [0, 0, 0])
    ticks = itertools.count()
    clocks = (lambda: next(ticks), lambda: next(ticks))
    engine = LLMEngine(model, num_blocks=32, block_size=4, attention_backend="torch")
    with engine_parts.timed_parts(acc, clocks=clocks):
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return dict(acc), engine


def test_parts_nest_and_count_on_the_shipped_model():
    model, _ = load_model(str(TINY_CODE_LLAMA_DIR))
    before = [getattr(owner, name) for owner, name, _ in engine_parts.PARTS]
    parts, engine = serve_with_ticks(model, [[1, 2, 3, 4, 5], [6, 7, 8]], max_tokens=4)
    assert [getattr(owner, name) for owner, name, _ in engine_parts.PARTS] == before

    # the layers' linear maps, attention and cache writes run inside the forward; the
    # LM head after it, holding its own linear map; nothing is timed twice at the top
    assert set(parts) == {FORWARD, FORWARD + ("linear maps",), FORWARD + ("cache writes",),
                          FORWARD + ("decode attention",), FORWARD + ("prefill attention",),
                          FORWARD + ("RMSNorm",), FORWARD + ("RoPE",),
                          HEAD, HEAD + ("linear maps",)}
    forwards, layers = parts[FORWARD][2], model.config.num_layers
    assert forwards == engine.stats.steps
    linear_calls = parts[FORWARD + ("linear maps",)][2]  # the same maps in every layer
    assert linear_calls > 0 and linear_calls % (forwards * layers) == 0
    assert parts[FORWARD + ("cache writes",)][2] == forwards * layers
    assert parts[FORWARD + ("RoPE",)][2] == forwards * layers  # Q and K rotated together
    assert parts[FORWARD + ("RMSNorm",)][2] == forwards * (2 * layers + 1)  # and the last
    assert parts[HEAD + ("linear maps",)][2] == parts[HEAD][2] == forwards

    # a child's readings lie inside its parent's: with one tick per reading the times
    # are counts, and parent = its children + its rest exactly, rest > 0 (the embedding,
    # the rotation angles, SwiGLU and the residual adds run there)
    table = {path: (wall, cpu) for path, wall, cpu, _ in engine_parts.rows(parts)}
    for parent in (FORWARD, HEAD):
        kids = [p for p in parts if len(p) == 2 and p[0] == parent[0]]
        for clock in (0, 1):
            assert parts[parent][clock] == (sum(parts[k][clock] for k in kids)
                                            + table[parent + ("rest",)][clock])
            assert all(parts[k][clock] < parts[parent][clock] for k in kids)
            assert table[parent + ("rest",)][clock] > 0


def test_rows_lists_each_parent_before_its_children_and_its_rest_after():
    parts = {("a",): (10.0, 8.0, 2), ("a", "x"): (3.0, 2.0, 5), ("a", "y"): (6.0, 5.0, 1),
             ("b",): (1.0, 1.0, 1)}
    assert engine_parts.rows(parts) == [
        (("a",), 10.0, 8.0, 2), (("a", "y"), 6.0, 5.0, 1), (("a", "x"), 3.0, 2.0, 5),
        (("a", "rest"), 1.0, 1.0, 0), (("b",), 1.0, 1.0, 1)]


@needs_smollm2
def test_the_bench_prints_every_part_under_its_parent_and_unwraps(capsys):
    before = [getattr(owner, name) for owner, name, _ in engine_parts.PARTS]
    assert engine_parts.main(["--requests", "3", "--max-tokens", "6"]) == 0
    assert [getattr(owner, name) for owner, name, _ in engine_parts.PARTS] == before
    assert nn.Linear.forward is before[3] and model_module.paged_attention is before[4]
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(" wall")[0].rstrip() for line in lines[1:]]
    assert names[0] == "  model forward"
    assert {"    linear maps", "    prefill attention", "    RMSNorm", "    rest (untimed)",
            "  LM head"} <= set(names)
    # backend="cpu" (auto, where the C library builds) rotates and writes in one pass, and
    # runs a decode step's layers as one call each (their parts timed with --layers-apart)
    fused = {"    RoPE and cache writes", "    residual add and RMSNorm",
             "    SwiGLU activation"}
    if cpu_layer.available():
        assert fused | {"    decode layers"} <= set(names)
        assert "    decode attention" not in names
        assert engine_parts.main(["--requests", "3", "--max-tokens", "6",
                                  "--layers-apart"]) == 0
        apart = capsys.readouterr().out
        assert "    decode attention" in apart and "decode layers" not in apart
    else:
        assert {"    RoPE", "    cache writes", "    decode attention"} <= set(names)
    head = names.index("  LM head")
    assert names[head + 1:] == ["    linear maps", "    rest (untimed)"]
    calls = {n: int(line.rsplit(", ", 1)[1].split()[0]) for n, line in zip(names, lines[1:],
                                                                              strict=True)
             if line.endswith("calls")}
    assert calls["  LM head"] > 0 and torch.get_num_threads() == 1
