"""verify/prediction.py: the target's own predictions as a per-row signal (a learned check, confirmed by the
target); the end-to-end case is tests/integration/test_rare_corruption.py (a forward corrupted upstream)."""

from __future__ import annotations


def test_the_prediction_check_flags_rows_far_below_their_peers_the_strongest_first():
    """verify/prediction.py on synthetic rows: a row whose next tokens the target's predictions match at 0% among
    rows at ~50% (binomial noise of their lengths) is flagged; clean rows are not; at most `cap` rows are flagged,
    the strongest first; too few rows skip the check."""
    import numpy as np

    from eagle3_pipeline.verify import prediction

    g = np.random.default_rng(0)
    rows = [(i, int(g.binomial(n, 0.5)), n) for i, n in enumerate(g.integers(40, 400, size=300))]
    flagged, s = prediction.judge(rows, 3.5)
    assert flagged == {} and s.rows == 300 and abs(s.median_rate - 0.5) < 0.03 and s.max_z < 3.5
    bad = rows + [(300, 0, 200), (301, 20, 200), (302, 2, 30)]
    flagged, s = prediction.judge(bad, 3.5)
    assert set(flagged) == {300, 301, 302} and s.flagged == s.above_limit == 3
    flagged, s = prediction.judge(bad, 3.5, cap=2)
    assert set(flagged) == {300, 301} and s.above_limit == 3  # 0/200 and 20/200 are further below than 2/30
    assert prediction.hits(np.array([[5, 6], [7, 1], [-1, -1], [0, 0]]), np.array([9, 5, 2, 3])) == (1, 2)
    _, s = prediction.judge(rows[:10], 3.5)
    assert s.skipped and "needs 20" in s.skipped
