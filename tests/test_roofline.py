"""The roofline arithmetic of `redjax bench offline` (`worker/bench/roofline.py`): which weights a
step multiplies, the FLOPs of prefill and decode, and the ideal decode step with its products and
attention one after another."""

from __future__ import annotations

import dataclasses

import pytest

from worker.bench import roofline
from worker.models.config import ModelConfig


@pytest.mark.parametrize("tied", [True, False])
def test_roofline_counts_only_the_weights_that_enter_products(tied):
    cfg = dataclasses.replace(ModelConfig.preset("llama-100m"), tie_word_embeddings=tied)
    norms = cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size
    table = cfg.vocab_size * cfg.hidden_size  # the embedding lookup reads rows, it multiplies nothing
    assert roofline.matmul_params(cfg) == cfg.num_params - norms - (0 if tied else table)
    assert roofline.prefill_token_flops(cfg) == 2 * (roofline.matmul_params(cfg) - table)
    assert roofline.decode_step_flops(cfg, 64, 0) == 64 * 2 * roofline.matmul_params(cfg)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 100  # q.k and p.v over 100 keys
    assert roofline.prefill_token_flops(cfg, 100) == roofline.prefill_token_flops(cfg) + attention
    assert roofline.decode_step_flops(cfg, 64, 100) == roofline.decode_step_flops(cfg, 64, 0) + 64 * attention


def test_the_serial_roofline_adds_the_products_and_the_attention():
    """The demo model's shape at 64 rows of 192 keys, on a machine of 30 GB/s and 200 GFLOP/s:
    products bound by their FLOPs, attention by reading the KV, so the step that runs them in turn
    takes the sum, more than the overlapped roofline's larger total."""
    cfg = dataclasses.replace(ModelConfig.preset("llama-tiny"), vocab_size=4096, hidden_size=256, intermediate_size=768,
                              num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32)
    weights = cfg.num_layers * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768) + 4096 * 256
    assert roofline.matmul_params(cfg) == weights
    products = 64 * 2 * weights / 200e9  # 2.5 ms of FLOPs against 0.6 ms of weights
    kv = 64 * 192 * (2 * 4 * 4 * 32 * 4)  # 50 MB: 1.7 ms, its FLOPs 0.2 ms
    serial = roofline.decode_serial_step_s(cfg, 4, 4, 64, 192, 192, 30.0, 200.0)
    assert serial == pytest.approx(products + kv / 30e9)
    overlapped = max(roofline.decode_step_bytes(cfg, 4, 64, 192) / 30e9, roofline.decode_step_flops(cfg, 64, 192) / 200e9)
    assert overlapped < serial <= roofline.decode_step_bytes(cfg, 4, 64, 192) / 30e9 + roofline.decode_step_flops(cfg, 64, 192) / 200e9
    # pages the prefix cache shares are read once (half the context here), but attended over in full;
    # bfloat16 pages read half the bytes
    assert roofline.decode_serial_step_s(cfg, 4, 4, 64, 192, 96, 30.0, 200.0) == pytest.approx(products + kv / 2 / 30e9)
    assert roofline.decode_serial_step_s(cfg, 4, 2, 64, 192, 192, 30.0, 200.0) == pytest.approx(products + kv / 2 / 30e9)
    # one row: the products read their weights (1.1 us of FLOPs against 568 us of bytes)
    assert roofline.decode_serial_step_s(cfg, 4, 4, 1, 192, 192, 30.0, 200.0) == pytest.approx(
        weights * 4 / 30e9 + 192 * 1024 * 4 / 30e9)


def test_int8_projections_count_a_byte_a_weight_at_their_own_speed():
    """`--quantization int8`: the projections' weights are read as bytes and multiplied at the int8
    probe's speed; the LM head keeps the model's dtype and speed, attention its FLOPs."""
    cfg = ModelConfig.preset("llama-100m")
    head = cfg.vocab_size * cfg.hidden_size
    projections = roofline.projection_params(cfg)
    assert roofline.weight_bytes(cfg, 4) == roofline.matmul_params(cfg) * 4
    assert roofline.weight_bytes(cfg, 4, 1) == projections + head * 4
    assert roofline.product_s(cfg, 64, 200.0) == pytest.approx(64 * 2 * roofline.matmul_params(cfg) / 200e9)
    assert roofline.product_s(cfg, 64, 200.0, 800.0) == pytest.approx(64 * 2 * (projections / 800e9 + head / 200e9))
    attention = roofline.attention_flops(cfg, 100)
    assert roofline.prefill_token_s(cfg, 100, 200.0) == pytest.approx(roofline.prefill_token_flops(cfg, 100) / 200e9)
    assert roofline.prefill_token_s(cfg, 100, 200.0, 800.0) == pytest.approx(2 * projections / 800e9 + attention / 200e9)
    kv = 64 * 192 * roofline.kv_bytes_per_token(cfg, 4)
    assert roofline.decode_step_bytes(cfg, 4, 64, 192, 4, 1) == projections + head * 4 + kv
    one_row = roofline.decode_serial_step_s(cfg, 4, 4, 1, 192, 192, 30.0, 200.0, 1, 800.0)
    assert one_row == pytest.approx((projections + head * 4) / 30e9 + 192 * roofline.kv_bytes_per_token(cfg, 4) / 30e9)
