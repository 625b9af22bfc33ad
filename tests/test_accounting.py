"""Chapter 01: KV bytes per token, blocks, weight memory, plots, calculator and graders."""

from __future__ import annotations

import math
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from paged_lib import accounting as acc  # noqa: E402
from paged_lib.accounting import SPECS, GiB, KiB, ModelSpec  # noqa: E402
from paged_lib.course.grading import ch01  # noqa: E402
from paged_lib.course.viz import accounting as viz  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ---------------------------------------------------------------- bytes per token


@pytest.mark.parametrize("name, expected", [
    ("opt-13b", 819_200),       # the paper's 800 KB: 2 x 5120 x 40 x 2
    ("llama-2-7b", 524_288),    # 512 KiB
    ("llama-2-13b", 819_200),
    ("llama-2-70b", 327_680),   # GQA-8: 320 KiB
    ("llama-3-8b", 131_072),    # GQA-8: 128 KiB
    ("mistral-7b", 131_072),
    ("falcon-7b", 8_192),       # MQA: one KV head of 64
    ("opt-66b", 2_359_296),
])
def test_kv_bytes_per_token_known_models(name, expected):
    assert acc.kv_bytes_per_token(SPECS[name]) == expected


def test_paper_numbers():
    opt = SPECS["opt-13b"]
    assert acc.kv_bytes_per_token(opt) == 800 * KiB == 2 * 5120 * 40 * 2
    assert acc.kv_bytes(opt, 2048) == 1_677_721_600  # 1600 MiB, "1.6 GB" in the paper
    assert acc.kv_bytes(opt, 2048) == 1600 * 2**20
    assert acc.kv_bytes_per_token(SPECS["llama-2-70b"]) == 320 * KiB
    assert acc.kv_bytes_per_token(SPECS["llama-2-7b"]) == 512 * KiB


def test_required_specs_and_kinds():
    for name in ("opt-13b", "llama-2-7b", "llama-2-13b", "llama-2-70b"):
        assert name in SPECS
    kinds = {s.attention for s in SPECS.values()}
    assert kinds == {"MHA", "GQA", "MQA"}
    assert SPECS["llama-2-70b"].group_size == 8
    for spec in SPECS.values():
        assert spec.dtype_bytes == 2
        assert spec.num_params > 0


def _llama_params(h, layers, heads, kv_heads, d, inter, vocab):
    attn = 2 * h * heads * d + 2 * h * kv_heads * d
    return layers * (attn + 3 * h * inter + 2 * h) + h + 2 * vocab * h


def _opt_params(h, layers, ffn, vocab=50272, positions=2050):
    layer = 4 * (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 4 * h
    return layers * layer + vocab * h + positions * h + 2 * h


@pytest.mark.parametrize("name, params", [
    ("llama-2-7b", _llama_params(4096, 32, 32, 32, 128, 11008, 32000)),
    ("llama-2-13b", _llama_params(5120, 40, 40, 40, 128, 13824, 32000)),
    ("llama-2-70b", _llama_params(8192, 80, 64, 8, 128, 28672, 32000)),
    ("mistral-7b", _llama_params(4096, 32, 32, 8, 128, 14336, 32000)),
    ("llama-3-8b", _llama_params(4096, 32, 32, 8, 128, 14336, 128256)),
    ("llama-3-70b", _llama_params(8192, 80, 64, 8, 128, 28672, 128256)),
    ("opt-6.7b", _opt_params(4096, 32, 16384)),
    ("opt-13b", _opt_params(5120, 40, 20480)),
    ("opt-66b", _opt_params(9216, 64, 36864)),
])
def test_num_params_match_architecture(name, params):
    """The stored parameter counts follow from the published layer shapes."""
    assert SPECS[name].num_params == params


def test_weight_bytes_and_fit():
    assert acc.weight_bytes(SPECS["opt-13b"]) == 2 * 12_853_473_280  # ~26 GB, paper Fig. 1
    assert acc.weight_bytes(SPECS["opt-13b"], "fp32") == 4 * 12_853_473_280
    l7 = SPECS["llama-2-7b"]
    free = 40 * GiB - acc.weight_bytes(l7)
    assert acc.requests_that_fit(l7, 40 * GiB, 2048) == free // (2048 * 512 * KiB) == 27
    assert acc.requests_that_fit(SPECS["llama-2-70b"], 80 * GiB, 2048) == 0  # weights > GPU
    with pytest.raises(ValueError, match="num_params"):
        acc.weight_bytes(ModelSpec("x", 1, 8, 1, 1, 8))


def test_with_dtype():
    l7 = SPECS["llama-2-7b"]
    assert acc.kv_bytes_per_token(l7.with_dtype("fp8")) == 256 * KiB
    assert acc.kv_bytes_per_token(l7.with_dtype("fp32")) == 1024 * KiB
    assert acc.kv_bytes_per_token(l7.with_dtype(1)) == 256 * KiB
    with pytest.raises(ValueError, match="unknown dtype"):
        l7.with_dtype("fp12")


@given(st.integers(0, 10**6), st.sampled_from(list(SPECS)))
def test_kv_bytes_linear(n, name):
    spec = SPECS[name]
    assert acc.kv_bytes(spec, n) == n * acc.kv_bytes_per_token(spec)


# ---------------------------------------------------------------- blocks


@pytest.mark.parametrize("tokens, block_size, blocks", [
    (0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3),
    (1000, 16, 63), (40, 16, 3), (5, 1, 5), (0, 1, 0), (100, 128, 1),
])
def test_num_blocks_edges(tokens, block_size, blocks):
    assert acc.num_blocks(tokens, block_size) == blocks


@given(st.integers(0, 10**6), st.integers(1, 512))
def test_num_blocks_is_ceil(n, bs):
    b = acc.num_blocks(n, bs)
    assert b == math.ceil(n / bs)
    assert (b - 1) * bs < n <= b * bs or (n == 0 and b == 0)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, message", [
    (lambda: acc.num_blocks(-1, 16), "num_tokens must be >= 0, got -1"),
    (lambda: acc.num_blocks(10, 0), "block_size must be >= 1, got 0"),
    (lambda: acc.num_blocks(10, -4), "block_size must be >= 1"),
    (lambda: acc.num_blocks(2.5, 16), "num_tokens must be an integer"),
    (lambda: acc.kv_bytes(SPECS["opt-13b"], -5), "num_tokens must be >= 0, got -5"),
    (lambda: acc.kv_bytes_per_token("opt-13b"), "expected a ModelSpec"),
    (lambda: ModelSpec("bad", 32, 4096, 32, 6, 128), "multiple of num_kv_heads"),
    (lambda: ModelSpec("bad", 32, 4096, 8, 16, 128), "cannot exceed num_heads"),
    (lambda: ModelSpec("bad", 0, 4096, 32, 32, 128), "num_layers must be a positive"),
    (lambda: ModelSpec("bad", 32, 4096, 32, 32, 128, dtype_bytes=0), "dtype_bytes"),
    (lambda: ModelSpec("bad", 32, 4096, 32, 0, 128), "num_kv_heads must be a positive"),
    (lambda: acc.get_spec("gpt-5"), "unknown model 'gpt-5'"),
    (lambda: acc.requests_that_fit(SPECS["opt-13b"], 40 * GiB, 0), "context_len must be >= 1"),
])
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_format_bytes():
    assert acc.format_bytes(819_200) == "800 KiB"
    assert acc.format_bytes(819_200, binary=False) == "819 KB"
    assert acc.format_bytes(1_677_721_600) == "1.56 GiB"
    assert acc.format_bytes(1_677_721_600, binary=False) == "1.68 GB"
    assert acc.format_bytes(512) == "512 B"
    assert acc.format_bytes(16 * 2**20) == "16 MiB"


# ---------------------------------------------------------------- plots and calculator


def test_kv_per_token_bars():
    names = ["opt-13b", "llama-2-7b", "llama-2-70b", "falcon-7b"]
    fig = viz.kv_per_token_bars(names)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches if p.get_width() > 0]
    assert heights == [800, 512, 320, 8]
    colors = [p.get_facecolor() for p in ax.patches if p.get_width() > 0]
    assert colors[0] == colors[1] != colors[2] != colors[3]  # MHA, MHA, GQA, MQA
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"MHA", "GQA", "MQA"}


def test_kv_vs_context_lines():
    names = ["opt-13b", "llama-2-7b", "llama-2-70b"]
    fig = viz.kv_vs_context(names, max_context=4096, gpu_gib=(40, 80))
    lines = fig.axes[0].get_lines()
    assert len(lines) == len(names) + 2
    x, y = lines[0].get_data()
    assert x[-1] == 4096
    assert y[-1] == pytest.approx(4096 * 800 * KiB / GiB)
    assert fig.axes[0].get_legend().get_texts()[2].get_text() == "llama-2-70b (GQA)"


def test_requests_fit_bars():
    names = ["opt-13b", "llama-2-7b", "llama-2-70b"]
    fig = viz.requests_fit_bars(names, gpu_gib=(40, 80), context_len=2048)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [f"{n} on {g} GiB" for n in names for g in (40, 80)]
    texts = [t.get_text() for t in ax.texts]
    assert texts[:4] == ["10 requests", "35 requests", "27 requests", "67 requests"]
    assert texts[4].startswith("weights (128 GiB) > GPU")


def test_kv_token_layout():
    fig = viz.kv_token_layout(["llama-2-7b", "llama-2-70b", "falcon-7b"])
    assert len(fig.axes) == 3
    assert "512 KiB" in fig.axes[0].get_title()
    assert "320 KiB" in fig.axes[1].get_title()
    assert "8 KiB" in fig.axes[2].get_title()


def test_calculator_report_numbers():
    text = viz.calculator_report("llama-2-7b", "fp16", 4096, 8, gpu_gib=80)
    assert "524,288 B = 512 KiB" in text
    assert "2,147,483,648 B = 2 GiB" in text
    assert "batch of 8: 17,179,869,184 B = 16 GiB" in text
    assert "at most 33 requests of 4,096 tokens fit in 80 GiB" in text
    assert "fits in 80 GiB" in text
    fp8 = viz.calculator_report("llama-2-70b", "fp8", 2048, 1, gpu_gib=80)
    assert "163,840 B = 160 KiB" in fp8
    assert "does NOT fit" in fp8
    with pytest.raises(ValueError, match="unknown dtype"):
        viz.calculator_report("llama-2-7b", "fp7", 10, 1)


def test_calculator_widget_builds():
    w = viz.calculator_widget()
    assert [c.description for c in w.children[:5]] == [
        "model", "dtype", "context (tokens)", "batch", "GPU (GiB)"]


# ---------------------------------------------------------------- graders


def _verdict(capsys, ex_id):
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert re.match(rf"^(✅|❌|⏳) \[{re.escape(ex_id)}\] ", first), out
    return first[0], out


def _todo(*_args):
    raise NotImplementedError()


def _kv_right(spec):
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes


GRADERS = [
    ("01.1", ch01.check_kv_bytes_per_token, _kv_right,
     lambda s: s.num_layers * s.num_kv_heads * s.head_dim * s.dtype_bytes,  # forgot K and V
     "multiply by 2"),
    ("01.1", ch01.check_kv_bytes_per_token, _kv_right,
     lambda s: 2 * s.num_layers * s.num_heads * s.head_dim * s.dtype_bytes,  # query heads
     "num_kv_heads, not num_heads"),
    ("01.2", ch01.check_logical_blocks, lambda n, bs: -(-n // bs),
     lambda n, bs: n // bs + 1,  # 16 tokens -> 2 blocks
     "exactly full"),
    ("01.2", ch01.check_logical_blocks, lambda n, bs: -(-n // bs),
     lambda n, bs: n // bs,
     "round up, not down"),
    ("01.3", ch01.check_last_block_fill,
     lambda n, bs: 0.0 if n == 0 else ((n - 1) % bs + 1) / bs,
     lambda n, bs: (n % bs) / bs,  # full last block reported as empty
     "multiple of block_size"),
    ("01.4", ch01.check_max_requests,
     lambda spec, budget, ctx, bs: (budget // (bs * _kv_right(spec))) // -(-ctx // bs),
     lambda spec, budget, ctx, bs: budget // (ctx * _kv_right(spec)),  # ignores blocks
     "whole blocks"),
]


@pytest.mark.parametrize("ex_id, grader, right, wrong, hint", GRADERS)
def test_grader_passes_right_fails_wrong(capsys, ex_id, grader, right, wrong, hint):
    grader(right)
    mark, out = _verdict(capsys, ex_id)
    assert mark == "✅", out
    grader(wrong)
    mark, out = _verdict(capsys, ex_id)
    assert mark == "❌", out
    assert "expected" in out and "hint:" in out and hint in out, out
    grader(_todo)
    mark, out = _verdict(capsys, ex_id)
    assert mark == "⏳", out


def test_grader_reports_exception_without_traceback(capsys):
    ch01.check_logical_blocks(lambda n, bs: n // 0)
    mark, out = _verdict(capsys, "01.2")
    assert mark == "❌" and "ZeroDivisionError" in out and "Traceback" not in out
