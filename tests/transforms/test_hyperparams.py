"""scale_hyperparams and pipemare_lr against values worked out by hand."""

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


def test_pipemare_lr_by_hand():
    rate = pj.transforms.pipemare_lr(0.4, delay=4, warmup_steps=100)
    assert float(rate(0)) == pytest.approx(0.1)  # α / τ
    assert float(rate(50)) == pytest.approx(0.4 / 4 ** 0.5)
    assert float(rate(100)) == pytest.approx(0.4) == float(rate(1000))
    decaying = pj.transforms.pipemare_lr(lambda t: 0.4 / (1 + t), delay=1, warmup_steps=10)
    assert float(decaying(3)) == pytest.approx(0.1)  # τ = 1: the base schedule
