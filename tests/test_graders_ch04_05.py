"""The graders of chapters 04 and 05 against the mistakes learners make.

For every exercise: the solution gets ✅, a stub gets ⏳, and each typical wrong answer
(and small bugs planted in the solution) gets ❌ with a hint that names the mistake.
"""

from __future__ import annotations

import torch

import paged_lib  # noqa: F401  (sets up the interpreter before anything Triton)
from paged_lib import attention as A
from paged_lib.grading import ch04
from paged_lib.util import cdiv

NEG_INF = float("-inf")


def _verdict(capsys, check, answer) -> str:
    check(answer)
    return capsys.readouterr().out


def _stub(*args):
    raise NotImplementedError()


# ---------------------------------------------------------------- 04.1 merge two states

def _merge_ok(a, b):
    return tuple(A.merge(A.SoftmaxState(*a), A.SoftmaxState(*b)))


def _merge_nan_on_empty(a, b):
    m = torch.maximum(a[0], b[0])
    wa, wb = torch.exp(a[0] - m), torch.exp(b[0] - m)
    return m, wa * a[1] + wb * b[1], wa[..., None] * a[2] + wb[..., None] * b[2]


def _merge_no_rescale(a, b):
    return torch.maximum(a[0], b[0]), a[1] + b[1], a[2] + b[2]


def _merge_exp_of_max(a, b):
    """Scales by exp(m) itself: overflows for scores around 1000."""
    m = torch.maximum(a[0], b[0])
    ea, eb, em = torch.exp(a[0]), torch.exp(b[0]), torch.exp(m)
    ea, eb = torch.nan_to_num(ea / em, nan=0.0), torch.nan_to_num(eb / em, nan=0.0)
    return m, ea * a[1] + eb * b[1], ea[..., None] * a[2] + eb[..., None] * b[2]


def _merge_min(a, b):
    m = torch.minimum(a[0], b[0])
    ms = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(a[0] - ms), torch.exp(b[0] - ms)
    return m, wa * a[1] + wb * b[1], wa[..., None] * a[2] + wb[..., None] * b[2]


def test_merge_grader(capsys):
    assert _verdict(capsys, ch04.check_merge_states, _merge_ok).startswith("✅ [04.1]")
    assert _verdict(capsys, ch04.check_merge_states, _stub).startswith("⏳ [04.1]")
    for bad, words in [(_merge_nan_on_empty, "NaN"), (_merge_no_rescale, "rescale"),
                       (_merge_exp_of_max, "1000"), (_merge_min, "max")]:
        out = _verdict(capsys, ch04.check_merge_states, bad)
        assert out.startswith("❌ [04.1]") and words in out, out
        assert "hint:" in out


# ------------------------------------------------- 04.2 online softmax through the table

def _paged_ok(q, k_cache, v_cache, block_table, seq_len, scale, *, bug=None):
    num_heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    qg = q.view(kv_heads, num_heads // kv_heads, d)
    state = (torch.full(qg.shape[:2], NEG_INF, dtype=q.dtype),
             torch.zeros(qg.shape[:2], dtype=q.dtype), torch.zeros(qg.shape, dtype=q.dtype))
    nb = cdiv(seq_len, block_size) + (1 if bug == "extra block" else 0)
    for j in range(nb):
        block = int(block_table[j])
        limit = seq_len - j * block_size + (1 if bug == "off by one" else 0)
        valid = torch.arange(block_size) < limit
        kb = torch.where(valid[:, None, None], k_cache[block], 0.0)
        vb = v_cache[block] if bug == "no value mask" else \
            torch.where(valid[:, None, None], v_cache[block], 0.0)
        scores = torch.einsum("kgd,tkd->kgt", qg, kb) * scale
        scores = scores.masked_fill(~valid, NEG_INF)
        new = A.block_state(scores, vb.transpose(0, 1)[:, None])
        if bug == "no rescale":
            state = (torch.maximum(state[0], new.m), state[1] + new.l, state[2] + new.acc)
        else:
            state = tuple(A.merge(A.SoftmaxState(*state), new))
    out = (state[2] / state[1][..., None]).reshape(num_heads, d)
    return out.float() if bug == "float32" else out


def _gather_fancy(q, k_cache, v_cache, block_table, seq_len, scale):
    bs = k_cache.shape[1]
    t = torch.arange(seq_len)
    blocks = block_table.long()[t // bs]
    k, v = k_cache[blocks, t % bs], v_cache[blocks, t % bs]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, -1)
    return torch.einsum("hn,nhd->hd", p, v)


def _gather_list_cat(q, k_cache, v_cache, block_table, seq_len, scale):
    bs = k_cache.shape[1]
    blocks = [int(b) for b in block_table[:cdiv(seq_len, bs)]]
    k = torch.cat([k_cache[b] for b in blocks])[:seq_len]
    v = torch.cat([v_cache[b] for b in blocks])[:seq_len]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, -1)
    return torch.einsum("hn,nhd->hd", p, v)


def _block_scores(q, k_cache, block, valid, scale):
    kv = k_cache.shape[2]
    qg = q.view(kv, q.shape[0] // kv, q.shape[1])
    kb = torch.where(valid[:, None, None], k_cache[block], 0.0)
    return torch.einsum("kgd,tkd->kgt", qg, kb).masked_fill(~valid, NEG_INF) * scale


def _two_pass(q, k_cache, v_cache, block_table, seq_len, scale):
    """Pass 1: the max over all blocks; pass 2: read K again for exp and V for the sum."""
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    nb = cdiv(seq_len, bs)
    valids = [torch.arange(bs) < seq_len - j * bs for j in range(nb)]
    m = torch.stack([_block_scores(q, k_cache, int(block_table[j]), valids[j], scale).amax(-1)
                     for j in range(nb)]).amax(0)
    denom = torch.zeros_like(m)
    acc = torch.zeros(kv, q.shape[0] // kv, q.shape[1], dtype=q.dtype)
    for j in range(nb):
        b = int(block_table[j])
        p = torch.exp(_block_scores(q, k_cache, b, valids[j], scale) - m[..., None])
        vb = torch.where(valids[j][:, None, None], v_cache[b], 0.0).transpose(0, 1)
        denom = denom + p.sum(-1)
        acc = acc + torch.einsum("kgt,ktd->kgd", p, vb)
    return (acc / denom[..., None]).reshape(q.shape)


def _collect_scores(q, k_cache, v_cache, block_table, seq_len, scale, *, cat=True):
    """Reads each block once, in order, but keeps every block's scores and values."""
    bs = k_cache.shape[1]
    scores, values = [], []
    for j in range(cdiv(seq_len, bs)):
        b = int(block_table[j])
        valid = torch.arange(bs) < seq_len - j * bs
        scores.append(_block_scores(q, k_cache, b, valid, scale))
        values.append(torch.where(valid[:, None, None], v_cache[b], 0.0).transpose(0, 1))
    if cat:
        p = torch.softmax(torch.cat(scores, -1), -1)
        return torch.einsum("kgt,ktd->kgd", p, torch.cat(values, 1)).reshape(q.shape)
    m = torch.stack([s.amax(-1) for s in scores]).amax(0)
    ps = [torch.exp(s - m[..., None]) for s in scores]
    acc = sum(torch.einsum("kgt,ktd->kgd", p, v) for p, v in zip(ps, values, strict=True))
    return (acc / sum(p.sum(-1) for p in ps)[..., None]).reshape(q.shape)


def _wrong_gqa(q, k_cache, v_cache, block_table, seq_len, scale):
    """Query head h paired with KV head h % num_kv_heads instead of h // group."""
    kv = k_cache.shape[2]
    h = q.shape[0]
    perm = torch.arange(h).view(h // kv, kv).t().reshape(-1)  # heads regrouped by h % kv
    out = _paged_ok(q[perm], k_cache, v_cache, block_table, seq_len, scale)
    return out[torch.argsort(perm)]


def test_paged_online_grader_passes_the_solution(capsys):
    out = _verdict(capsys, ch04.check_paged_online, _paged_ok)
    assert out == "✅ [04.2] Online-softmax attention through a block table: correct\n", out
    assert _verdict(capsys, ch04.check_paged_online, _stub).startswith("⏳ [04.2]")


def test_paged_online_grader_fails_wrong_answers(capsys):
    cases = [
        (_gather_fancy, "gathers many blocks"),
        (_gather_list_cat, "concatenated"),
        (_two_pass, "read twice"),
        (_collect_scores, "concatenated"),
        (lambda *a: _collect_scores(*a, cat=False), "still hold"),
        (_wrong_gqa, "KV head h // "),
    ]
    for bad, words in cases:
        out = _verdict(capsys, ch04.check_paged_online, bad)
        assert out.startswith("❌ [04.2]") and words in out, (bad, out)
        assert "hint:" in out and "Traceback" not in out


def test_paged_online_grader_catches_planted_bugs(capsys):
    for bug, words in [("off by one", "NaN"), ("no value mask", "NaN"),
                       ("extra block", "padding"), ("no rescale", "rescale"),
                       ("float32", "dtype")]:
        out = _verdict(capsys, ch04.check_paged_online,
                       lambda *a, bug=bug: _paged_ok(*a, bug=bug))
        assert out.startswith("❌ [04.2]") and words in out, (bug, out)


# ---------------------------------------------------------------- 04.3 flash vs paged

def test_flash_vs_paged_grader(capsys):
    right = {i: ans for i, (_, ans, _) in enumerate(ch04.STATEMENTS, 1)}
    assert _verdict(capsys, ch04.check_flash_vs_paged, lambda: right).startswith("✅ [04.3]")
    online_is_both = {**right, 3: "both"}  # "vLLM's kernels use the online softmax"
    out = _verdict(capsys, ch04.check_flash_vs_paged, lambda: online_is_both)
    assert out.startswith("❌ [04.3]") and "two-pass" in out
    for bad in [lambda: {i: "both" for i in right}, lambda: ["flash"],
                lambda: {**right, 1: "Flash attention"}]:
        assert _verdict(capsys, ch04.check_flash_vs_paged, bad).startswith("❌ [04.3]")


def test_twins_name_real_objects():
    import importlib

    for dotted in ch04.TWINS.values():
        module, name = dotted.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), name), dotted
