"""An audit of chapters 00-04's graders: wrong answers that passed (or failed without a hint
naming their mistake) and right answers of other shapes than the solution's."""

from __future__ import annotations

import pytest

from paged_lib.accounting import kv_bytes_per_token
from paged_lib.course.grading import ch01
from paged_lib.util import cdiv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out
    return out


def _max(spec, budget, bs, per_request):
    return budget // (bs * kv_bytes_per_token(spec)) // per_request


@pytest.mark.parametrize("answer, hint", [
    # a slot for the token the request will produce next (02's prompt + s + 1, too early)
    (lambda s, budget, ctx, bs: _max(s, budget, bs, cdiv(ctx + 1, bs)), "no slot for a next"),
    # bytes per token from hidden_size: wrong where head_dim != hidden_size / num_heads
    (lambda s, budget, ctx, bs: budget // (bs * 2 * s.num_layers * s.hidden_size
                                           * s.dtype_bytes) // cdiv(ctx, bs), "not hidden_size"),
])
def test_01_4_slips_are_named(capsys, answer, hint):
    out = verdict(capsys, ch01.check_max_requests, answer)
    assert out.startswith("❌ [01.4]") and hint in out, out
