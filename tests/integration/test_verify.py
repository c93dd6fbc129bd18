"""The verify gate catches real corruptions of real extracted files, each with a precise message,
and passes the clean extraction."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.verify.reference import choose_rows, reference_check
from eagle3_pipeline.verify.structure import verify_structure

ROWS = [0, 1, 2]


@pytest.fixture()
def hs_copy(extracted, tmp_path):
    d = tmp_path / "hidden_states"
    d.mkdir()
    for r in ROWS:
        shutil.copy(extracted.hidden_states / f"hs_{r}.safetensors", d)
    return d


def _rewrite(path: Path, fn):
    rec = load_file(str(path))
    save_file(fn(rec), str(path))


def _check(extracted, d, rows=ROWS):
    return verify_structure(extracted.tokenized, d, extracted.layer_ids, extracted.hidden_size, rows=rows, log=lambda m: None)


def test_clean_extraction_passes(extracted):
    res = _check(extracted, extracted.hidden_states, rows=None)
    assert res.passed, res.problems[:5]
    assert [s.layer_id for s in res.layer_stats] == extracted.layer_ids
    assert all(s.std > 0 for s in res.layer_stats)


CORRUPTIONS = {
    # the `[0]` bug: one index too many collapses [T, L, H] to [L, H]
    "collapsed layer list": (lambda r: {**r, "hidden_states": r["hidden_states"][0]}, "expected [{T}, 4, 128], found [4, 128]"),
    "missing final layer": (lambda r: {**r, "hidden_states": r["hidden_states"][:, :3].contiguous()}, "(3 layers captured, 4 configured"),
    "hidden size mismatch": (lambda r: {**r, "hidden_states": r["hidden_states"][..., :64].contiguous()}, "expected [{T}, 4, 128], found [{T}, 4, 64]"),
    "wrong dtype": (lambda r: {**r, "hidden_states": r["hidden_states"].to(torch.float16)}, "dtype expected torch.bfloat16, found torch.float16"),
    "NaN": (lambda r: {**r, "hidden_states": r["hidden_states"].index_put_((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("nan"), dtype=torch.bfloat16))}, "layer 5: 128 non-finite values (first at token 1)"),
    "Inf": (lambda r: {**r, "hidden_states": r["hidden_states"].index_put_((torch.tensor([0]), torch.tensor([0]), torch.tensor([7])), torch.tensor(float("inf"), dtype=torch.bfloat16))}, "layer 2: 1 non-finite values"),
    "zero layer": (lambda r: {**r, "hidden_states": r["hidden_states"].index_fill_(1, torch.tensor([1]), 0)}, "layer 4: all zeros"),
    "duplicated layer": (lambda r: {**r, "hidden_states": torch.stack([r["hidden_states"][:, 0]] * 2 + [r["hidden_states"][:, 2], r["hidden_states"][:, 3]], 1)}, "layers 2 and 4 are identical"),
    "missing key": (lambda r: {"hidden_states": r["hidden_states"]}, "key 'token_ids' missing"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_structural_corruption_is_caught(extracted, hs_copy, case):
    fn, msg = CORRUPTIONS[case]
    f = hs_copy / "hs_1.safetensors"
    T = load_file(str(f))["token_ids"].shape[0]
    _rewrite(f, fn)
    res = _check(extracted, hs_copy)
    assert not res.passed and res.bad_rows == [1]
    assert any(msg.format(T=T) in p for p in res.problems), res.problems
    assert all(p.startswith("hs_1.safetensors (row 1, sample ") for p in res.problems)


def test_truncated_file(extracted, hs_copy):
    f = hs_copy / "hs_2.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res = _check(extracted, hs_copy)
    assert res.bad_rows == [2] and "unreadable" in res.problems[0]


def test_tokens_of_another_sample(extracted, hs_copy):
    other = load_file(str(hs_copy / "hs_0.safetensors"))["token_ids"]
    _rewrite(hs_copy / "hs_1.safetensors", lambda r: {**r, "token_ids": other[: r["token_ids"].shape[0]].clone()}
             if other.shape[0] >= r["token_ids"].shape[0] else {**r, "token_ids": other.clone()})
    res = _check(extracted, hs_copy)
    assert res.bad_rows == [1] and "token_ids" in res.problems[0]


def test_samples_swapped_between_files(extracted, hs_copy):
    a, b = hs_copy / "hs_0.safetensors", hs_copy / "hs_1.safetensors"
    tmp = hs_copy / "swap"
    a.rename(tmp), b.rename(a), tmp.rename(b)
    res = _check(extracted, hs_copy)
    assert res.bad_rows == [0, 1]


def test_layer_off_by_one_is_caught_by_the_reference(extracted, hs_copy, tiny_target):
    """Structure cannot see a wrong layer id; recomputing with HF transformers can."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    f = hs_copy / "hs_1.safetensors"
    rec = load_file(str(f))
    with torch.no_grad():
        hs = model(input_ids=rec["token_ids"][None], output_hidden_states=True).hidden_states
    shifted = rec["hidden_states"].clone()
    shifted[:, 0] = hs[3][0].to(torch.bfloat16)  # captured layer 3 where layer 2 was asked for
    save_file({**rec, "hidden_states": shifted}, str(f))
    assert _check(extracted, hs_copy).passed  # structurally perfect
    ref = reference_check(str(tiny_target), extracted.tokenized, hs_copy, extracted.layer_ids, ROWS, log=lambda m: None)
    assert ref.bad_rows == [1]
    assert any("hs_1" in p and "layer 2 differs from the reference" in p for p in ref.problems), ref.problems
    clean = reference_check(str(tiny_target), extracted.tokenized, extracted.hidden_states, extracted.layer_ids,
                            ROWS, log=lambda m: None)
    assert not clean.problems and clean.max_rel_err < 0.05 and clean.min_cosine > 0.99


def test_reference_sample_choice_covers_extremes_and_shards():
    lens = [10, 50, 3, 7, 99, 20, 30, 40]
    rows = choose_rows(lens, 4, rows_per_shard=3)
    assert 4 in rows and 2 in rows and len({r // 3 for r in rows}) >= 2
