"""MLA in paged_lib.accounting (chapter 11): DeepSeek-V2's latent, the GQA it equals, the
same-model MHA it replaces, and the specs kept apart from SPECS."""

from __future__ import annotations

import re

import pytest

from paged_lib import accounting as acc
from paged_lib.accounting import DEEPSEEK_SPECS, SPECS, ModelSpec


def test_deepseek_v2_caches_a_latent_and_a_rope_key_per_layer():
    v2 = DEEPSEEK_SPECS["deepseek-v2"]
    assert v2.attention == "MLA"
    assert acc.kv_bytes_per_token(v2) == 60 * (512 + 64) * 2 == 69_120  # no factor 2 for K, V
    assert acc.kv_bytes_per_token(v2.with_dtype("fp8")) == 34_560
    assert acc.gqa_groups(v2) == 2.25  # DeepSeek-V2 §2.1.4: "GQA with only 2.25 groups"


def test_same_model_mha_and_deepseek_67b():
    v2, d67 = DEEPSEEK_SPECS["deepseek-v2"], DEEPSEEK_SPECS["deepseek-llm-67b"]
    mha = acc.mha_equivalent(v2)
    assert mha.attention == "MHA" and mha.kv_lora_rank == mha.qk_rope_head_dim == 0
    assert acc.kv_bytes_per_token(mha) == 2 * 60 * 128 * 128 * 2
    assert acc.kv_bytes_per_token(d67) == 2 * 95 * 8 * 128 * 2 == 389_120
    assert 1 - acc.kv_bytes_per_token(v2) / acc.kv_bytes_per_token(mha) == pytest.approx(
        1 - 576 / 32_768)
    # the paper's 93.3% against DeepSeek 67B follows with its served 6 bits per element
    six_bits = acc.kv_bytes_per_token(v2) * 6 / 16
    assert f"{1 - six_bits / acc.kv_bytes_per_token(d67):.1%}" == "93.3%"


@pytest.mark.parametrize("name", list(SPECS))
def test_mha_equivalent_of_the_published_specs(name):
    spec = SPECS[name]
    mha = acc.mha_equivalent(spec)
    assert acc.kv_bytes_per_token(mha) == acc.kv_bytes_per_token(spec) * spec.group_size
    assert acc.gqa_groups(spec) == spec.num_kv_heads  # a GQA model equals itself
    assert spec.attention != "MLA"


def test_get_spec_finds_both_tables_and_specs_stay_apart():
    assert acc.get_spec("deepseek-v2") is DEEPSEEK_SPECS["deepseek-v2"]
    assert acc.get_spec("opt-13b") is SPECS["opt-13b"]
    assert not set(SPECS) & set(DEEPSEEK_SPECS)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_lora_rank=-1), "kv_lora_rank must be a non-negative integer, got -1"),
    (dict(qk_rope_head_dim=64), "qk_rope_head_dim (64) is an MLA field; set kv_lora_rank"),
    (dict(kv_lora_rank=512, qk_rope_head_dim=2.5), "qk_rope_head_dim must be a non-negative"),
])
def test_bad_mla_fields_raise(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelSpec("bad", 4, 64, 4, 4, 16, **kwargs)


def test_repr_shows_mla_fields_only_when_set():
    assert repr(SPECS["llama-2-70b"]) == (
        "ModelSpec(name='llama-2-70b', num_layers=80, hidden_size=8192, num_heads=64, "
        "num_kv_heads=8, head_dim=128, dtype_bytes=2, num_params=68976648192)")
    assert repr(DEEPSEEK_SPECS["deepseek-v2"]).endswith(
        "num_params=0, kv_lora_rank=512, qk_rope_head_dim=64)")
