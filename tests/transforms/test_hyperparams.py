"""scale_hyperparams, scale_adam_hyperparams, lr_schedule, pipemare_lr and the named mitigations'
scaling against values worked out by hand."""

import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError


def test_scale_hyperparams_by_hand():
    # B → B/4: m′ = 0.9^(1/4); η′ = η·(1/4)·(1 − m′)/(1 − 0.9)
    lr, m = pj.transforms.scale_hyperparams(0.1, 0.9, 128, 32)
    assert m == pytest.approx(0.9 ** 0.25)
    assert lr == pytest.approx(0.1 * 0.25 * (1 - 0.9 ** 0.25) / 0.1)
    # momentum half-life in samples is kept: m′^(B/B′) = m
    assert m ** 4 == pytest.approx(0.9)
    assert pj.transforms.scale_hyperparams(0.1, 0.9, 64, 64) == pytest.approx((0.1, 0.9))
    assert pj.transforms.scale_hyperparams(0.1, 0.0, 64, 16) == pytest.approx((0.025, 0.0))
    with pytest.raises(ConfigError, match="new_batch=0"):
        pj.transforms.scale_hyperparams(0.1, 0.9, 64, 0)


def test_scale_adam_hyperparams_by_hand():
    """Batch 32 → 4, κ = 1/8: η/√8, 1 − β by κ, ε·√8, decay λ/√8 (η·λ per sample kept)."""
    adam = pj.transforms.AdamW(0.9, 0.95, 1e-8, weight_decay=0.1)
    lr, scaled = pj.transforms.scale_adam_hyperparams(3e-3, adam, 32, 4)
    assert lr == pytest.approx(3e-3 / 8 ** 0.5)
    assert (scaled.b1, scaled.b2) == pytest.approx((1 - 0.1 / 8, 1 - 0.05 / 8))
    assert scaled.eps == pytest.approx(1e-8 * 8 ** 0.5)
    assert lr * scaled.weight_decay / 4 == pytest.approx(3e-3 * 0.1 / 32)
    schedule, _ = pj.transforms.scale_adam_hyperparams(lambda t: 1e-3 * t, adam, 32, 8)
    assert float(schedule(3)) == pytest.approx(3e-3 / 2)
    with pytest.raises(ConfigError, match="the rule holds for κ\\(1 − β\\) <= 1"):
        pj.transforms.scale_adam_hyperparams(1e-3, pj.transforms.AdamW(0.5), 4, 32)


def test_pipemare_lr_by_hand():
    rate = pj.transforms.pipemare_lr(0.4, delay=4, warmup_steps=100)
    assert float(rate(0)) == pytest.approx(0.1)  # α / τ
    assert float(rate(50)) == pytest.approx(0.4 / 4 ** 0.5)
    assert float(rate(100)) == pytest.approx(0.4) == float(rate(1000))
    decaying = pj.transforms.pipemare_lr(lambda t: 0.4 / (1 + t), delay=1, warmup_steps=10)
    assert float(decaying(3)) == pytest.approx(0.1)  # τ = 1: the base schedule


def test_scale_hyperparams_of_a_schedule_scales_its_values():
    # B 128 → 1: the factor η′/η = (1/128)·(1 − 0.9^(1/128))/(1 − 0.9), the same at every step
    rate, m = pj.transforms.scale_hyperparams(
        optax.piecewise_constant_schedule(0.1, {10: 0.1}), 0.9, 128, 1)
    factor = (1 / 128) * (1 - 0.9 ** (1 / 128)) / 0.1
    assert m == pytest.approx(0.9 ** (1 / 128))
    assert float(rate(0)) == pytest.approx(0.1 * factor)
    assert float(rate(10)) == pytest.approx(0.01 * factor)


def test_papers_reference_scaled_to_update_size_one():
    # Kosson et al.'s regime: lr 0.1, m 0.9 at B = 128 → B′ = 1: m′ = 0.9^(1/128) = 0.999177,
    # η′ = 0.1·(1/128)·(1 − m′)/0.1 = 6.428e-6
    mit = pj.transforms.mitigation("lwp+sc", reference=(0.1, 0.9, 128), batch=1)
    assert mit.momentum == pytest.approx(0.9991772, abs=1e-7)
    assert mit.learning_rate == pytest.approx(6.428e-6, rel=1e-3)
    with pytest.raises(ConfigError, match="needs batch="):
        pj.transforms.mitigation("none", reference=(0.1, 0.9, 128))
    with pytest.raises(ConfigError, match="leave learning_rate and momentum out"):
        pj.transforms.mitigation("none", 0.1, reference=(0.1, 0.9, 128), batch=1)
    with pytest.raises(ConfigError, match="SGD with momentum"):
        pj.transforms.mitigation("none", reference=(0.1, 0.9, 128), batch=1, optimizer="adam")


def test_lr_schedules_by_hand():
    step = pj.transforms.lr_schedule("step", 1.0, 100)  # ×0.1 at 50 and 75
    assert [float(step(t)) for t in (0, 49, 50, 74, 75, 99)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01])
    cosine = pj.transforms.lr_schedule("cosine", 2.0, 100)
    assert [float(cosine(t)) for t in (0, 50, 100)] == pytest.approx([2.0, 1.0, 0.0], abs=1e-6)
    warm = pj.transforms.lr_schedule("step", 1.0, 110, warmup_steps=10, decay_at=(0.5,))
    assert [float(warm(t)) for t in (0, 5, 10, 59, 60)] == pytest.approx([0, 0.5, 1, 1, 0.1])
    assert float(pj.transforms.lr_schedule("constant", 0.3, 5)(4)) == pytest.approx(0.3)
    with pytest.raises(ConfigError, match="unknown learning-rate schedule 'linear'"):
        pj.transforms.lr_schedule("linear", 1.0, 10)
    with pytest.raises(ConfigError, match="decay_at"):
        pj.transforms.lr_schedule("step", 1.0, 10, decay_at=(1.5,))


def test_pipemare_mitigation_rates_by_hand():
    # stage delay τ = 4, K_warm = 100, η = 0.4: the first update is −0.4/4·g with g = 1
    opt = pj.transforms.mitigation("pipemare", 0.4, momentum=0.0, warmup_steps=100).optimizer(
        pj.StageInfo(0, 3, 4, 4, 0))
    w = {"w": jnp.zeros(())}
    u, _ = opt.update({"w": jnp.ones(())}, opt.init(w), w)
    assert float(u["w"]) == pytest.approx(-0.1)
    with pytest.raises(ConfigError, match="warmup_steps=K_warm"):
        pj.transforms.mitigation("pipemare", 0.4)
