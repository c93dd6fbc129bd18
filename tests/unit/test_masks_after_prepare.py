"""Masks judged where training reads them (verify/masks.py): prepare keeps each row's hash as it judged it, and a
tokenized dataset changed after prepare (a mask shifted one token later, before extraction takes its own hashes)
is named row by row."""

from __future__ import annotations

import shutil
from pathlib import Path

from eagle3_pipeline.core.config import PrepareConfig, SourceConfig, TargetConfig
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.prepare.stage import prepare
from eagle3_pipeline.verify.masks import mask_problems, prepared_hashes


def test_a_mask_shifted_after_prepare_is_named(tiny_target, tmp_path):
    import datasets

    corpus = tiny_target / "corpus"
    cfg = PrepareConfig(sources=[SourceConfig(path=str(corpus / "sharegpt.jsonl"), limit=40)], heldout_rows=2)
    res = prepare(cfg, TargetConfig(model=str(tiny_target)), tmp_path / "store", log=lambda _: None)
    ds = load_tokenized(res.tokenized)
    prepared = prepared_hashes(res.tokenized)
    assert res.row_hashes and len(prepared) == len(ds) == res.rows_out
    assert mask_problems(ds, [], list(range(len(ds))), prepared) == ([], [], len(ds))  # clean rows: none named

    shifted = {1, 5, 9}  # the masks of three rows moved one token later, as a buggy rewrite would
    plain = datasets.load_from_disk(res.tokenized).with_format(None)

    def shift(row, i):
        if i in shifted:
            row["loss_mask"] = [0] + row["loss_mask"][:-1]
        return row

    changed = plain.map(shift, with_indices=True)
    tmp = Path(res.tokenized).with_name("tokenized.new")
    changed.save_to_disk(str(tmp))
    shutil.rmtree(res.tokenized)
    tmp.rename(res.tokenized)
    found, bad, compared = mask_problems(load_tokenized(res.tokenized), [], list(range(len(ds))),
                                         prepared_hashes(res.tokenized))
    assert bad == sorted(shifted) and compared == len(ds)
    assert all("is not the one prepare judged" in p and "changed after prepare" in p for p in found)
