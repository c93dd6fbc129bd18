"""The extent of a bad extraction (verify/extent.py): the interval of the bad fraction, and local against spread."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from eagle3_pipeline.verify.extent import Evidence, assess, clopper_pearson

SHARDS = [SimpleNamespace(index=i, row_start=i * 10, row_end=(i + 1) * 10) for i in range(20)]  # 200 rows
GROUPS = [list(range(g * 5, (g + 1) * 5)) for g in range(4)]  # 4 engine processes of 5 shards
SAMPLE = list(range(0, 200, 4))  # 50 rows, 2 or 3 in every shard
ENGINE = {"vllm": "0.32.0", "tensor_parallel_size": 8}


def test_clopper_pearson_matches_known_intervals():
    lo, hi = clopper_pearson(0, 59)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 59), rel=1e-6)  # the rule of three's exact form
    lo, hi = clopper_pearson(3, 57)
    assert lo == pytest.approx(0.01099, abs=2e-4) and hi == pytest.approx(0.14614, abs=2e-4)
    lo, hi = clopper_pearson(57, 57)
    assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / 57), rel=1e-6)
    assert clopper_pearson(0, 0) == (0.0, 1.0)


def test_per_record_damage_is_named_without_condemning_anything():
    ext = assess(Evidence(SAMPLE, set(), {3, 4}), 200, SHARDS, GROUPS, ENGINE)
    assert ext.verdict == "records" and ext.named == 2 and ext.reextract_rows == 0


def test_damage_in_every_group_is_spread_and_names_what_computes():
    bad = {r for r in range(200) if (r * 7919 + 3) % 20 == 0}  # one row in 20, everywhere
    ext = assess(Evidence(SAMPLE, bad, set(), cleared=set(SAMPLE) - bad), 200, SHARDS, GROUPS, ENGINE)
    assert ext.verdict == "spread" and ext.reextract_rows == 200
    k = len(set(SAMPLE) & bad)
    assert ext.bad_in_sample == k and ext.bad_fraction == pytest.approx(k / 50)
    assert ext.ci95[0] < 0.05 < ext.ci95[1]  # the true rate lies in the interval
    assert "would reproduce it" in ext.says and "vllm 0.32.0" in ext.says and "tensor_parallel_size 8" in ext.says


def test_damage_in_one_engine_process_is_local_to_its_group():
    bad = {r for r in SAMPLE if 100 <= r < 150}  # group 2 (shards 10-14) computed wrongly, the others not
    ext = assess(Evidence(SAMPLE, bad, set()), 200, SHARDS, GROUPS, ENGINE)
    assert ext.verdict == "local" and ext.hit_groups == [2] and ext.reextract_rows == 50
    assert "shard group(s) [2]" in ext.says and ext.unjudged == 150 - len([r for r in SAMPLE if not 100 <= r < 150])


def test_damage_in_one_shard_is_local_to_it():
    ext = assess(Evidence(SAMPLE, {40}, set(), escalated=list(range(41, 50)), cleared=set(range(41, 50))),
                 200, SHARDS, [list(range(20))], ENGINE)
    assert ext.verdict == "local" and ext.hit_shards == [4] and ext.reextract_rows == 10 and ext.escalated == 9
    assert math.isclose(ext.bad_fraction, 1 / 50)
