"""Round 51's wrong answers to chapters 09-14 that a grader let through, each now ❌ with a
hint naming it, and the right answers of another shape beside them (✅)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_generated_numeric import int8_write  # 11.3 block by block; code= how a value codes

from paged_lib.course.grading import ch11

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


def test_11_3_codes_by_the_reciprocal_of_the_scale_are_named(capsys):
    """v * (1 / scale) misses exact ties (the generated comparison lets a code one off at a
    tie by, and served values hold none): a named value 125.5 x its scale shows it."""
    out = verdict(capsys, ch11.check_write_int8_blocks,
                  functools.partial(int8_write, code=lambda v, s: torch.round(v * (1 / s))))
    assert out.startswith("❌ [11.3]") and "125.5 times 1.1015625" in out \
        and "v * (1 / scale) rounds 1 / scale first" in out, out


def int8_whole_call(x, data, scale, slots):
    """11.3 right, for every block of the call at once (scatter_reduce for the need)."""
    nb, bs, heads, _ = data.shape
    blocks, offsets = slots // bs, slots % bs
    need = torch.zeros(nb, heads).scatter_reduce(
        0, blocks[:, None].expand(-1, heads), x.abs().amax(-1) / 127, "amax")
    touched = torch.zeros(nb, dtype=torch.bool).index_fill(0, blocks, True)
    fresh = torch.zeros(nb, dtype=torch.bool).index_fill(0, blocks[offsets == 0], True)
    old = torch.where(fresh[:, None], 0.0, scale.nan_to_num(nan=0.0))
    new = torch.where(need > old, torch.maximum(need, 2 * old), old).clamp(
        min=torch.finfo(torch.float32).tiny)
    ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
    data[touched] = (data[touched].float() * ratio[touched][:, None, :, None]).round().clamp(
        -127, 127).to(torch.int8)
    scale[touched] = new[touched]
    data[blocks, offsets] = (x / new[blocks][:, :, None]).round().clamp(-127, 127).to(torch.int8)


@pytest.mark.parametrize("right", [int8_write, int8_whole_call])
def test_11_3_codes_by_division_pass(capsys, right):
    out = verdict(capsys, ch11.check_write_int8_blocks, right)
    assert out.startswith("✅ [11.3]"), out
