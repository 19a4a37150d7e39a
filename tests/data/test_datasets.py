"""Embedded data sets, user .npz files and deterministic batches."""

import numpy as np
import pytest

import pipejax as pj
from pipejax.errors import DataError


def test_mnist1d_is_generated_offline_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEJAX_CACHE", str(tmp_path))
    d = pj.data.mnist1d(num_samples=200)
    assert d.x_train.shape == (160, 40) and d.x_test.shape == (40, 40)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32 and d.classes == 10
    assert len(list(tmp_path.glob("mnist1d-*.npz"))) == 1
    again = pj.data.mnist1d(num_samples=200)
    np.testing.assert_array_equal(d.x_train, again.x_train)


def test_digits_are_images():
    d = pj.data.digits()
    assert d.x_train.shape[1:] == (8, 8, 1) and d.classes == 10
    assert len(d.x_train) + len(d.x_test) == 1797


def test_npz_roundtrip_and_errors(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, x_train=np.zeros((6, 3)), y_train=np.arange(6), x_test=np.zeros((2, 3)),
             y_test=np.arange(2))
    assert pj.data.load(str(good)).x_train.shape == (6, 3)
    bad = tmp_path / "bad.npz"
    np.savez(bad, x_train=np.zeros((6, 3)), y_train=np.arange(6))
    with pytest.raises(DataError, match=r"lacks arrays \['x_test', 'y_test'\]"):
        pj.data.npz(bad)
    mismatch = tmp_path / "mismatch.npz"
    np.savez(mismatch, x_train=np.zeros((6, 3)), y_train=np.arange(5), x_test=np.zeros((2, 3)),
             y_test=np.arange(2))
    with pytest.raises(DataError, match="x_train holds 6 examples but y_train holds 5"):
        pj.data.npz(mismatch)
    with pytest.raises(DataError, match="does not exist"):
        pj.data.npz(tmp_path / "missing.npz")
    with pytest.raises(DataError, match="unknown data 'mnist2d'"):
        pj.data.load("mnist2d")


def test_batches_are_deterministic_by_seed_and_epoch():
    x, y = np.arange(20)[:, None].astype(np.float32), np.arange(20)
    a = [b[1] for b in pj.data.batches(x, y, 6, seed=1, epoch=0)]
    b = [b[1] for b in pj.data.batches(x, y, 6, seed=1, epoch=0)]
    c = [b[1] for b in pj.data.batches(x, y, 6, seed=1, epoch=1)]
    assert len(a) == 3 and all(len(v) == 6 for v in a)
    assert all((p == q).all() for p, q in zip(a, b))
    assert any((p != q).any() for p, q in zip(a, c))
