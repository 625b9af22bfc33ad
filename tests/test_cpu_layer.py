"""The decoder layer's small steps in C (``paged_lib.kernels.cpu_layer``) against PyTorch's.

Each loop is held to the PyTorch operations the model runs otherwise: the rotation and the
cache write exactly (same products, same sums), the norms and SwiGLU's activation to
float32's last bits. Shapes are the awkward ones (rows not a multiple of the 8-float
vectors, one row, head sizes other than 64), values span tiny to extreme, and the caches
start NaN, so a write to a wrong slot or a read of one shows. The model then runs whole
steps through them (``backend="cpu"``, ``validate=False``) against the PyTorch path.
Skipped, with the reason, on a machine with no C compiler.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import paged_lib  # noqa: F401  # isort: split
from paged_lib.kernels import cpu_decode, cpu_layer
from paged_lib.model import AttentionMetadata, TinyLlama, TinyLlamaConfig, apply_rope, rope_cos_sin

try:
    cpu_decode.library()
except cpu_decode.KernelUnavailable as err:  # pragma: no cover - machines without cc
    pytest.skip(str(err), allow_module_level=True)


def rows(n: int, dim: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # each row its own magnitude, from tiny to large
    mags = 10.0 ** torch.linspace(-6, 3, n)[:, None] if n > 1 else torch.ones(1, 1)
    return torch.randn(n, dim, generator=g) * mags * scale


@pytest.mark.parametrize("n,dim", [(1, 576), (8, 64), (3, 13), (33, 100)])
def test_rms_norm_and_the_residual_step_equal_torch(n, dim):
    x, h, w = rows(n, dim, 0), rows(n, dim, 1), torch.randn(dim)
    torch.testing.assert_close(cpu_layer.rms_norm(x, w, 1e-5), F.rms_norm(x, (dim,), w, 1e-5),
                               rtol=2e-6, atol=0)
    before = x.clone()
    total, normed = cpu_layer.add_rms_norm(x, h, w, 1e-5)
    assert torch.equal(x, before) and torch.equal(total, x + h)  # its inputs kept
    torch.testing.assert_close(normed, F.rms_norm(x + h, (dim,), w, 1e-5), rtol=2e-6, atol=0)


@pytest.mark.parametrize("inter", [1536, 7, 24])
def test_silu_mul_equals_torch_from_tiny_to_overflow(inter):
    gate_up = torch.cat([rows(6, inter, 2, 30.0), rows(6, inter, 3)], dim=1)
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # e^200 overflows; e^-200 is 0
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(cpu_layer.silu_mul(gate_up), want, rtol=2e-6, atol=1e-30)


def test_many_rows_share_out_between_threads_with_the_same_bits(one_torch_thread):
    """A prefill's rows (past the C loops' thresholds for a second thread) give the same
    numbers on two threads as on one, and still torch's."""
    x, h, w = rows(300, 576, 4), rows(300, 576, 5), torch.randn(576)
    gate_up = torch.cat([rows(40, 1536, 6, 30.0), rows(40, 1536, 7)], dim=1)
    one = (cpu_layer.rms_norm(x, w, 1e-5), *cpu_layer.add_rms_norm(x, h, w, 1e-5),
           cpu_layer.silu_mul(gate_up))
    torch.set_num_threads(2)  # the fixture puts 1 back
    two = (cpu_layer.rms_norm(x, w, 1e-5), *cpu_layer.add_rms_norm(x, h, w, 1e-5),
           cpu_layer.silu_mul(gate_up))
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    torch.testing.assert_close(two[2], F.rms_norm(x + h, (576,), w, 1e-5), rtol=2e-6, atol=0)
    torch.testing.assert_close(two[3], F.silu(gate_up[:, :1536]) * gate_up[:, 1536:],
                               rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (6, 2, 40)])
def test_rope_and_write_rotates_as_apply_rope_and_writes_only_its_slots(heads, kv_heads, d):
    n, block_size, blocks = 5, 4, 6
    qkv = rows(n, (heads + 2 * kv_heads) * d, 4)
    cos, sin = rope_cos_sin(torch.tensor([0, 3, 100, 8000, 4]), d, 1e5, torch.float32)
    shape = (blocks, block_size, kv_heads, d)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    slots = torch.tensor([23, 0, 9, 10, 17])  # any order, blocks apart
    q = cpu_layer.rope_and_write(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    qk = apply_rope(qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d), cos, sin)
    assert torch.equal(q, qk[:, :heads])  # the same products and sums, bit for bit
    assert torch.equal(k_cache.view(-1, kv_heads, d)[slots], qk[:, heads:])
    assert torch.equal(v_cache.view(-1, kv_heads, d)[slots],
                       qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d))
    others = torch.ones(blocks * block_size, dtype=torch.bool)
    others[slots] = False
    assert k_cache.view(-1, kv_heads, d)[others].isnan().all()
    assert v_cache.view(-1, kv_heads, d)[others].isnan().all()


def test_bad_input_is_refused_with_what_was_wrong():
    x, w = torch.ones(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="weight of 8"):
        cpu_layer.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="h must be contiguous"):
        cpu_layer.add_rms_norm(x, torch.ones(2, 7), w, 1e-5)
    with pytest.raises(ValueError, match="gate_up must be"):
        cpu_layer.silu_mul(torch.ones(2, 7))
    cos = sin = torch.ones(2, 4)
    cache = torch.zeros(2, 2, 1, 4)
    with pytest.raises(ValueError, match="qkv must be"):
        cpu_layer.rope_and_write(torch.ones(2, 11), cos, sin, cache, cache.clone(),
                                 torch.tensor([0, 1]), 1, 1)
    with pytest.raises(ValueError, match="k_cache must be"):
        cpu_layer.rope_and_write(torch.ones(2, 12), cos, sin, cache.half(), cache.clone(),
                                 torch.tensor([0, 1]), 1, 1)
    with pytest.raises(ValueError, match="slots must be"):
        cpu_layer.rope_and_write(torch.ones(2, 12), cos, sin, cache, cache.clone(),
                                 torch.tensor([0, 1], dtype=torch.int32), 1, 1)


def test_applies_only_to_checked_float32_inference_steps_of_the_cpu_backend():
    x = torch.ones(2, 8)
    with torch.no_grad():
        assert cpu_layer.applies(x, "cpu", validate=False)
        assert not cpu_layer.applies(x, "torch", validate=False)
        assert not cpu_layer.applies(x, "cpu", validate=True)
        assert not cpu_layer.applies(x.half(), "cpu", validate=False)
        assert not cpu_layer.applies(x.t(), "cpu", validate=False)
    assert not cpu_layer.applies(x, "cpu", validate=False)  # autograd on


@torch.no_grad()
def test_model_steps_through_the_c_loops_equal_the_torch_path(monkeypatch):
    """A prefill of two sequences, then decodes, through ``backend="cpu"`` without and with
    the C loops (``validate=True`` keeps the PyTorch steps): the same logits, the same
    caches, and nothing written outside the steps' slots."""
    cfg = TinyLlamaConfig(num_layers=2, hidden_size=48, num_heads=6, num_kv_heads=2,
                          head_dim=24, intermediate_size=40, vocab_size=50)
    torch.manual_seed(0)
    model = TinyLlama(cfg).eval()
    block_size, blocks = 4, 8
    shape = (blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    calls = []
    for name in ("rope_and_write", "rms_norm", "add_rms_norm", "silu_mul", "decode_layers"):
        fn = getattr(cpu_layer, name)
        monkeypatch.setattr(cpu_layer, name,
                            lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    runs = {}
    for validate in (False, True):
        caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                  for _ in range(cfg.num_layers)]
        tables = torch.tensor([[5, 2, 7, -1], [0, 3, -1, -1]], dtype=torch.int32)
        lens, logits = [0, 0], []
        for step, new in enumerate([(6, 3), (1, 1), (1, 1), (1, 0)]):
            seqs = [s for s in range(2) if new[s]]
            pos = torch.cat([torch.arange(lens[s], lens[s] + new[s]) for s in seqs])
            owner = torch.cat([torch.full((new[s],), s) for s in seqs])
            slots = tables[owner, pos // block_size].long() * block_size + pos % block_size
            for s in seqs:
                lens[s] += new[s]
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=tables[seqs],
                seq_lens=torch.tensor([lens[s] for s in seqs], dtype=torch.int32),
                query_lens=torch.tensor([new[s] for s in seqs], dtype=torch.int32),
                positions=pos, max_seq_len=max(lens), max_query_len=max(new))
            ids = torch.arange(len(pos)) * 7 % cfg.vocab_size + step
            hidden = model(ids, caches, meta, backend="cpu", validate=validate)
            logits.append(model.compute_logits(hidden[meta.logits_indices]))
        runs[validate] = torch.cat(logits), caches
    # each step took the C loops, and only without validate: per step the first layer's
    # norm, then per layer the prefill's rotation, two residual adds with the norm after
    # each and the activation; each of the three decode steps' layers as one call
    assert sorted(set(calls)) == ["add_rms_norm", "decode_layers", "rms_norm",
                                  "rope_and_write", "silu_mul"]
    assert len(calls) == (1 + 4 * cfg.num_layers) + 3 * 2
    assert calls.count("rms_norm") == 4
    (fused, fused_caches), (plain, plain_caches) = runs[False], runs[True]
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for (k1, v1), (k2, v2) in zip(fused_caches, plain_caches, strict=True):
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert k1.isnan().sum() == k2.isnan().sum() > 0  # untouched slots stay NaN


def decode_steps(model, caches, tables: torch.Tensor, lens: list[int], steps: int,
                 block_size: int) -> list[torch.Tensor]:
    """``steps`` decode steps (one new token per sequence, its K/V at its next slot) after
    the cache already holds ``lens`` tokens each; the logits of each step."""
    out, lens = [], list(lens)
    for step in range(steps):
        lens = [n + 1 for n in lens]
        pos = torch.tensor(lens) - 1
        slots = tables[torch.arange(len(lens)), pos // block_size].long() * block_size \
            + pos % block_size
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables, seq_lens=torch.tensor(
                lens, dtype=torch.int32), query_lens=torch.ones(len(lens), dtype=torch.int32),
            positions=pos, max_seq_len=max(lens), max_query_len=1)
        ids = (torch.arange(len(lens)) * 5 + step) % model.config.vocab_size
        out.append(model.compute_logits(model(ids, caches, meta, backend="cpu",
                                              validate=False)))
    return out


@pytest.mark.parametrize("batch,threads", [(1, 1), (3, 2), (8, 2), (130, 2), (5, 1)])
@torch.no_grad()
def test_a_decode_steps_layers_in_one_call_give_the_same_bits_as_their_steps(
        monkeypatch, batch, threads):
    """``cpu_layer.decode_layers`` (a decode step's layers on one thread team) against the
    same layers' steps called one by one: the same logits and caches, bit for bit, at
    batches from one sequence to past a 128-row block of the linear kernel, with head
    sizes that are not ``hidden / heads``, lengths that end anywhere in a block, tables in
    any order, and the untouched slots still NaN."""
    cfg = TinyLlamaConfig(num_layers=2, hidden_size=48, num_heads=6, num_kv_heads=2,
                          head_dim=24, intermediate_size=40, vocab_size=50)
    torch.manual_seed(batch)
    model = TinyLlama(cfg).eval()
    for i, norm in enumerate(m for m in model.modules() if m.__class__.__name__ == "RMSNorm"):
        norm.weight.normal_()  # each norm its own weights and eps, so none stands in for
        norm.eps = 10.0 ** -(i + 1)  # another
    block_size, per_seq = 4, 4
    blocks = batch * per_seq
    g = torch.Generator().manual_seed(batch)
    tables = torch.randperm(blocks, generator=g).to(torch.int32).view(batch, per_seq)
    lens = torch.randint(1, block_size * per_seq - 3, (batch,), generator=g).tolist()
    start = (torch.randn(blocks, block_size, cfg.num_kv_heads, cfg.head_dim, generator=g),
             torch.randn(blocks, block_size, cfg.num_kv_heads, cfg.head_dim, generator=g))
    for b, n in zip(tables.tolist(), lens, strict=True):  # past each length: NaN
        for i in range(n, block_size * per_seq):
            start[0][b[i // block_size], i % block_size] = float("nan")
            start[1][b[i // block_size], i % block_size] = float("nan")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    runs, calls = {}, []
    real = cpu_layer.decode_layers
    monkeypatch.setattr(cpu_layer, "decode_layers", lambda *a, **k: calls.append(1) or real(
        *a, **k))
    for fused in (True, False):
        model.decode_layers_in_one_call = fused
        caches = [(start[0].clone(), start[1].clone()) for _ in range(cfg.num_layers)]
        runs[fused] = decode_steps(model, caches, tables, lens, 3, block_size), caches
    assert len(calls) == 3  # each step's layers took one call
    (fused, fused_caches), (steps, step_caches) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(fused, steps, strict=True))
    assert all(f.isfinite().all() for f in fused)
    for (k1, v1), (k2, v2) in zip(fused_caches, step_caches, strict=True):
        assert torch.equal(k1.nan_to_num(7.0), k2.nan_to_num(7.0))
        assert torch.equal(v1.nan_to_num(7.0), v2.nan_to_num(7.0))
        written = 3 * batch * cfg.num_kv_heads * cfg.head_dim  # 3 slots a sequence
        assert k1.isnan().sum() == start[0].isnan().sum() - written


@torch.no_grad()
def test_decode_layers_leave_to_the_steps_what_they_do_not_run():
    """A prefill, int8 caches or a map the C kernel did not pack: ``None`` (the caller then
    runs the steps one by one); maps that do not fit the shapes: a ValueError saying so."""
    from paged_lib.kernels.cpu_linear import LinearWeights

    cfg = TinyLlamaConfig(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1,
                          head_dim=8, intermediate_size=12, vocab_size=20)
    torch.manual_seed(0)
    layer = TinyLlama(cfg).eval().layers[0]
    maps, norm = (*layer.self_attn.maps(), *layer.mlp.maps()), layer.post_attention_layernorm
    x, cache = torch.randn(1, 16), torch.zeros(2, 4, 1, 8)
    cos, sin = rope_cos_sin(torch.tensor([2]), 8, 1e4, torch.float32)
    meta = AttentionMetadata(slot_mapping=torch.tensor([2]), block_tables=torch.tensor(
        [[1, -1]], dtype=torch.int32), seq_lens=torch.tensor([3], dtype=torch.int32),
        query_lens=torch.tensor([1], dtype=torch.int32), positions=torch.tensor([2]),
        max_seq_len=3, max_query_len=1)

    def call(maps=maps, k_cache=cache, meta=meta):
        plan = cpu_layer.DecodeLayers([(maps, (norm, norm))], 16, 2, 1)
        return cpu_layer.decode_layers(x.clone(), x.clone(), plan, [(k_cache, cache.clone())],
                                       cos, sin, meta)

    assert call() is not None
    prefill = AttentionMetadata(**{**vars(meta), "max_query_len": 2})
    assert call(meta=prefill) is None
    assert call(k_cache=cache.half()) is None
    assert call(maps=(*maps[:3], LinearWeights([layer.mlp.down_proj.weight], c_kernel=False))
                ) is None
    with pytest.raises(ValueError, match="layer 0's maps"):
        call(maps=(maps[1], *maps[1:]))
    with pytest.raises(ValueError, match="caches must be"):
        call(k_cache=torch.zeros(2, 4, 1, 6))


@torch.no_grad()
def test_a_weight_changed_in_place_or_replaced_between_steps_is_read_anew():
    """The plan of a model's layers is kept between steps: a weight multiplied in place, a
    weight replaced by another tensor, a layer's MLP swapped for another, or another cache
    must each be read anew (the same logits as the steps apart, which look the weights up
    at every call)."""
    cfg = TinyLlamaConfig(num_layers=2, hidden_size=48, num_heads=6, num_kv_heads=2,
                          head_dim=24, intermediate_size=40, vocab_size=50)
    block_size, g = 4, torch.Generator().manual_seed(3)
    tables = torch.randperm(12, generator=g).to(torch.int32).view(3, 4)
    runs = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = TinyLlama(cfg).eval()
        model.decode_layers_in_one_call = fused
        caches = [(torch.randn(12, block_size, 2, 24, generator=torch.Generator().manual_seed(
            i)), torch.randn(12, block_size, 2, 24)) for i in range(2)]
        out = decode_steps(model, caches, tables, [3, 5, 8], 2, block_size)
        model.layers[1].mlp.down_proj.weight.mul_(3.0)  # in place: its version changes
        out += decode_steps(model, caches, tables, [5, 7, 10], 1, block_size)
        model.layers[0].self_attn.k_proj.weight = torch.nn.Parameter(
            torch.randn(48, 48, generator=torch.Generator().manual_seed(4)))  # replaced
        out += decode_steps(model, caches, tables, [6, 8, 11], 1, block_size)
        caches = [(k.clone(), v.clone()) for k, v in caches]  # the same values elsewhere
        out += decode_steps(model, caches, tables, [7, 9, 12], 1, block_size)
        mlp = copy.deepcopy(model.layers[1].mlp)  # (registers modules: a plan built anew)
        mlp.up_proj.weight.mul_(-1.0)
        out += decode_steps(model, caches, tables, [8, 10, 13], 1, block_size)
        model.layers[1].mlp = mlp  # swapped: none of the plan's own weights changed
        out += decode_steps(model, caches, tables, [9, 11, 14], 1, block_size)
        runs[fused] = out
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False], strict=True))
    assert not torch.equal(runs[True][1], runs[True][2])


@torch.no_grad()
def test_a_decode_attention_put_in_the_models_place_is_the_one_decode_steps_call(
        monkeypatch):
    """Chapter 13 serves the learner's kernel by putting it in place of
    ``paged_lib.model.paged_attention``: decode steps must then call it for every layer,
    not run the layers in one C call that would skip it."""
    import paged_lib.model as model_module

    cfg = TinyLlamaConfig(num_layers=2, hidden_size=48, num_heads=6, num_kv_heads=2,
                          head_dim=24, intermediate_size=40, vocab_size=50)
    torch.manual_seed(0)
    model, calls = TinyLlama(cfg).eval(), []
    library = model_module.paged_attention
    monkeypatch.setattr(model_module, "paged_attention",
                        lambda *a, **k: calls.append(1) or library(*a, **k))
    caches = [(torch.randn(8, 4, 2, 24), torch.randn(8, 4, 2, 24)) for _ in range(2)]
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    decode_steps(model, caches, tables, [3, 6], 2, 4)
    assert len(calls) == 2 * cfg.num_layers
