"""vocab stage: speculators' d2t (offsets) / t2d (mask) conventions, padding, special ids, checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from eagle3_pipeline.core.config import VocabConfig
from eagle3_pipeline.records.vocab import VocabError, check_vocab, load_vocab
from eagle3_pipeline.vocab.stage import build_vocab

V = 64


def _freq(tmp_path, counts, name="token_freq.safetensors"):
    p = tmp_path / name
    save_file({"counts": np.asarray(counts, dtype=np.int64)}, str(p))
    return p


def test_offset_round_trip_and_speculators_loader(tmp_path):
    counts = np.zeros(V, dtype=np.int64)
    counts[[5, 9, 40, 41, 63, 2]] = [100, 90, 80, 70, 60, 1]
    res = build_vocab(VocabConfig(draft_vocab_size=4), _freq(tmp_path, counts), V, tmp_path / "v", [])
    d2t, t2d = load_vocab(tmp_path / "v", V)
    assert d2t.dtype == np.int64 and d2t.shape == (4,) and t2d.dtype == np.bool_ and t2d.shape == (V,)
    target_ids = np.arange(4) + d2t  # offset convention: target id = i + d2t[i]
    assert target_ids.tolist() == [5, 9, 40, 41]
    assert np.nonzero(t2d)[0].tolist() == [5, 9, 40, 41]
    assert res.coverage == pytest.approx(340 / 401)
    assert res.d2t_path.name == "d2t-4.npy" and res.t2d_path.name == "t2d-4.npy"
    # speculators' own loader reads the files as they are
    from speculators.train.cli import _load_mappings

    sd2t, st2d, k = _load_mappings(res.d2t_path, res.t2d_path, 4)
    assert k == 4 and sd2t.tolist() == d2t.tolist() and st2d.tolist() == t2d.tolist()


def test_matches_speculators_builder(tmp_path):
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 20, size=V)
    res = build_vocab(VocabConfig(draft_vocab_size=16), _freq(tmp_path, counts), V, tmp_path / "v", [])
    d2t, t2d = load_vocab(tmp_path / "v")
    ref_d2t, ref_t2d = build_vocab_mappings_from_distribution(
        {i: int(c) for i, c in enumerate(counts) if c}, 16, V)
    assert torch.equal(torch.from_numpy(d2t), ref_d2t) and torch.equal(torch.from_numpy(t2d), ref_t2d)
    assert res.distinct_tokens == int((counts > 0).sum())


def test_padding_when_few_distinct_tokens(tmp_path):
    counts = np.zeros(V, dtype=np.int64)
    counts[[50, 60]] = [3, 7]
    res = build_vocab(VocabConfig(draft_vocab_size=5), _freq(tmp_path, counts), V, tmp_path / "v", [])
    d2t, t2d = load_vocab(tmp_path / "v")
    # the two seen ids, then the lowest unused ids
    assert (np.arange(5) + d2t).tolist() == [0, 1, 2, 50, 60]
    assert res.padded == 3 and res.coverage == 1.0 and int(t2d.sum()) == 5


def test_special_tokens_forced_in(tmp_path):
    counts = np.arange(V, dtype=np.int64)  # id 63 most frequent, id 1 nearly never
    res = build_vocab(VocabConfig(draft_vocab_size=4), _freq(tmp_path, counts), V, tmp_path / "v", [1])
    d2t, t2d = load_vocab(tmp_path / "v")
    assert t2d[1] and (np.arange(4) + d2t).tolist() == [1, 61, 62, 63]
    assert res.forced_special == [1]
    meta = json.loads((tmp_path / "v" / "vocab.json").read_text())
    assert meta["special_token_ids"] == [1]


def test_shorter_counts_are_padded_and_json_is_read(tmp_path):
    p = tmp_path / "tf.json"
    p.write_text(json.dumps({"3": 5, "7": 2}))
    res = build_vocab(VocabConfig(draft_vocab_size=2), p, V, tmp_path / "v", [])
    assert res.target_vocab_size == V and res.coverage == 1.0
    d2t, t2d = load_vocab(tmp_path / "v", V)
    assert t2d.shape == (V,) and np.nonzero(t2d)[0].tolist() == [3, 7]


def test_wrong_d2t_is_caught(tmp_path):
    counts = np.zeros(V, dtype=np.int64)
    counts[[5, 9, 40, 41]] = 1
    build_vocab(VocabConfig(draft_vocab_size=4), _freq(tmp_path, counts), V, tmp_path / "v", [])
    d2t, t2d = load_vocab(tmp_path / "v")
    # absolute ids instead of offsets: the classic mistake
    with pytest.raises(VocabError, match="disagree at draft id 1"):
        check_vocab(np.arange(4) + d2t, t2d, V)
    shifted = d2t.copy()
    shifted[3] += 30  # maps past the end of the target vocab
    with pytest.raises(VocabError, match="draft id 3 maps to target id 71"):
        check_vocab(shifted, t2d, V)
    with pytest.raises(VocabError, match=r"t2d marks 3 target ids, expected 4"):
        bad = t2d.copy()
        bad[5] = False
        check_vocab(d2t, bad, V)
    with pytest.raises(VocabError, match=r"expected shape \[65\]"):
        check_vocab(d2t, t2d, V + 1)
    with pytest.raises(VocabError, match=r"special token ids \[0\]"):
        check_vocab(d2t, t2d, V, [0])
    with pytest.raises(VocabError, match="int64"):
        check_vocab(d2t.astype(np.int32), t2d, V)
    # a tampered file on disk is caught when loading
    np.save(tmp_path / "v" / "d2t-4.npy", shifted)
    with pytest.raises(VocabError, match="draft id 3"):
        load_vocab(tmp_path / "v")


def test_bad_inputs(tmp_path):
    counts = np.ones(V, dtype=np.int64)
    with pytest.raises(VocabError, match="draft_vocab_size=65"):
        build_vocab(VocabConfig(draft_vocab_size=V + 1), _freq(tmp_path, counts), V, tmp_path / "v", [])
    with pytest.raises(VocabError, match=r"ids >= target vocab size 32"):
        build_vocab(VocabConfig(draft_vocab_size=4), _freq(tmp_path, counts), 32, tmp_path / "v", [])
    with pytest.raises(VocabError, match="no supervised tokens"):
        build_vocab(VocabConfig(draft_vocab_size=4), _freq(tmp_path, np.zeros(V)), V, tmp_path / "v", [])
    with pytest.raises(VocabError, match=r"special token ids \[99\]"):
        build_vocab(VocabConfig(draft_vocab_size=4), _freq(tmp_path, counts), V, tmp_path / "v", [99])
