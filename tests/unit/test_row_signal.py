"""verify/row_signal.py: the target's surprise at each row against the row's bigram difficulty (a learned check,
confirmed by the target). Its measured power on real forwards is in docs/verification.md
(bench/row_signal_power.py); end to end: tests/integration/test_rare_corruption.py."""

from __future__ import annotations

import numpy as np

from eagle3_pipeline.verify import row_signal


def _markov_rows(g, n_rows: int, vocab: int = 40):
    """Rows from two sources: a near-deterministic chain (easy) and a uniform one (hard), in varying mixes."""
    nxt = g.integers(0, vocab, size=vocab)
    rows = []
    for _ in range(n_rows):
        p_easy = g.uniform(0.1, 0.95)
        t = [int(g.integers(vocab))]
        for _ in range(int(g.integers(60, 200))):
            t.append(int(nxt[t[-1]]) if g.random() < p_easy else int(g.integers(vocab)))
        rows.append(t)
    return rows, nxt


def _gaps(g, ids, nxt, shift: float = 0.0):
    """A target's gaps: 0 where the chain's successor follows, about -3 elsewhere, plus noise (and `shift`)."""
    a = np.asarray(ids)
    gap = np.where(nxt[a[:-1]] == a[1:], 0.0, -3.0) + g.normal(0, 0.5, size=len(a) - 1) - shift
    gap = np.minimum(gap, 0.0)
    return float(gap.sum()), float((gap * gap).sum()), len(gap)


def test_the_bigram_difficulty_explains_what_rows_share_and_leaves_each_row_out():
    g = np.random.default_rng(0)
    rows, _ = _markov_rows(g, 200)
    d = row_signal.bigram_difficulty(rows)
    assert len(d) == 200 and all(n == len(r) - 1 for (_, n), r in zip(d, rows))
    assert all(v <= 0 for v, _ in d)
    # a row of pairs seen nowhere else scores hard: its own pairs are left out
    lonely = row_signal.bigram_difficulty(rows + [[39, 38, 37, 36] * 20])[-1][0]
    assert lonely < min(v for v, _ in d)


def test_rows_more_surprised_than_rows_as_predictable_are_flagged_the_strongest_first():
    """Row difficulty varies a lot (the hit rate's spread, which hid weak corruptions); the bigram explains it, so
    a row the target finds 1 nat a token more surprising than its difficulty says stands out, and clean rows
    do not. At most `cap` are flagged, the strongest first; too few rows skip the check."""
    g = np.random.default_rng(1)
    rows, nxt = _markov_rows(g, 300)
    y = [v for v, _ in row_signal.bigram_difficulty(rows)]
    clean = [(i, _gaps(g, r, nxt), y[i]) for i, r in enumerate(rows)]
    flagged, s = row_signal.judge(clean, 4.0)
    assert flagged == {} and s.rows == 300 and s.max_z < 4.0 and s.slope > 0.5
    bad = {7: 1.0, 50: 1.5, 123: 1.2}
    rows_bad = [(i, _gaps(np.random.default_rng(i), rows[i], nxt, bad[i]) if i in bad else gp, yy)
                for i, gp, yy in clean]
    flagged, s = row_signal.judge(rows_bad, 4.0)
    assert set(flagged) == set(bad) and s.above_limit == 3
    flagged, _ = row_signal.judge(rows_bad, 4.0, cap=2)
    assert set(flagged) == {50, 123}  # the two strongest
    # without the bigram (every row equally hard), the same shifts drown in the rows' spread of difficulty
    flagged_flat, _ = row_signal.judge([(i, gp, 0.0) for i, gp, _ in rows_bad], 4.0)
    assert not set(flagged_flat) & set(bad)
    _, s = row_signal.judge(clean[:10], 4.0)
    assert s.skipped and "needs 20" in s.skipped


def test_the_gap_sums_survive_the_verify_cache(tmp_path):
    """verify/cache.py keeps each good record's gap sums, so a re-run judges reused rows by the same numbers
    (a record without a fingerprint keeps none)."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    from eagle3_pipeline.verify import cache
    from eagle3_pipeline.verify.structure import STAT_ROWS, FileResult

    rs = [FileResult(row=3, tokens=40, nbytes=9, stats=np.zeros((STAT_ROWS, 2)), gaps=(-12.5, 40.25, 39),
                     next_hits=20, next_scored=39),
          FileResult(row=5, tokens=8, nbytes=9, stats=np.zeros((STAT_ROWS, 2)))]
    save_file(cache._columns(rs), str(tmp_path / "c.safetensors"))  # noqa: SLF001 - the cache's own columns
    t = load_file(str(tmp_path / "c.safetensors"))
    a, b = (cache._result(t, i, r.row) for i, r in enumerate(rs))  # noqa: SLF001
    assert a.gaps == (-12.5, 40.25, 39) and a.next_hits == 20 and b.gaps is None and b.next_scored is None
