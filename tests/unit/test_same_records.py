"""The record comparison the crash and concurrency tests rely on (tests/helpers/store.same_records): it
passes what another engine process computes (the same records, a bf16 step off here and there) and fails
on everything a lost, doubled, misplaced or half-written record would look like."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.store import ROUNDING, record_matches, same_records

META = {"format": "eagle3-record"}


def _states(seed: int, tokens: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"token_ids": torch.randint(0, 900, (tokens,), generator=g),
            "hidden_states": (torch.randn(tokens, 4, 128, generator=g) * 3).to(torch.bfloat16)}


def _write(path: Path, tensors: dict, metadata: dict = META) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


def _one_step_off(t: torch.Tensor, frac: float = 0.025, seed: int = 0) -> torch.Tensor:
    """`t` (bf16) with `frac` of its elements moved to the next representable value: what the deviating
    engine of the 2026-12-06 CI run stored."""
    g = torch.Generator().manual_seed(seed)
    bits = t.view(torch.int16).clone()
    hit = torch.rand(t.shape, generator=g) < frac
    bits[hit] += 1
    return bits.view(torch.bfloat16)


def test_equal_bytes_and_rounding_pass(tmp_path):
    ref = _write(tmp_path / "ref/hs_0.safetensors", _states(0))
    same = _write(tmp_path / "same/hs_0.safetensors", _states(0))
    assert record_matches(same, ref) is True
    s = _states(0)
    s["hidden_states"] = _one_step_off(s["hidden_states"])
    near = _write(tmp_path / "near/hs_0.safetensors", s)
    assert record_matches(near, ref) is False  # not the same bytes, the same record


@pytest.mark.parametrize("what", ["other_row", "one_token_wrong", "token_ids", "shape", "metadata", "dtype"])
def test_a_different_record_fails(tmp_path, what):
    ref = _write(tmp_path / "ref/hs_0.safetensors", _states(0))
    s, meta = _states(0), META
    if what == "other_row":
        s["hidden_states"] = _states(1)["hidden_states"]
    elif what == "one_token_wrong":  # one position's states from elsewhere, the rest exact
        s["hidden_states"][7] = _states(1)["hidden_states"][7]
    elif what == "token_ids":
        s["token_ids"][3] += 1
    elif what == "shape":
        s = _states(0, tokens=39)
    elif what == "metadata":
        meta = {"format": "eagle3-record", "layer_ids": "[1, 2]"}
    elif what == "dtype":
        s["hidden_states"] = s["hidden_states"].float()
    bad = _write(tmp_path / "bad/hs_0.safetensors", s, meta)
    with pytest.raises(AssertionError):
        record_matches(bad, ref)


def test_the_bound_sits_between_rounding_and_content(tmp_path):
    """ROUNDING is above what a bf16 step on every element gives (the engines differed on ~2.5% of them) and far
    below a neighbouring record's states."""
    s = _states(0)["hidden_states"].float()
    every_step = _one_step_off(s.to(torch.bfloat16), frac=1.0).float()
    rounding = float((every_step - s).norm(dim=-1).max() / s.norm(dim=-1).mean())
    other = _states(1)["hidden_states"].float()
    content = float((other - s).norm(dim=-1).max() / s.norm(dim=-1).mean())
    assert rounding < ROUNDING and content > 20 * ROUNDING, (rounding, content)


def test_same_records_names_the_missing_and_the_rounded(tmp_path, capsys):
    for sub, name in (("hidden_states", "hs_0"), ("fingerprints", "fp_0")):
        _write(tmp_path / "ref" / sub / f"{name}.safetensors", _states(0))
    shutil.copytree(tmp_path / "ref", tmp_path / "out")
    assert same_records(tmp_path / "out", tmp_path / "ref") == []
    s = _states(0)
    s["hidden_states"] = _one_step_off(s["hidden_states"])
    _write(tmp_path / "out/hidden_states/hs_0.safetensors", s)
    assert same_records(tmp_path / "out", tmp_path / "ref") == ["hs_0.safetensors"]
    assert "rounding level" in capsys.readouterr().out
    (tmp_path / "out/fingerprints/fp_0.safetensors").unlink()
    with pytest.raises(AssertionError, match="fp_0"):
        same_records(tmp_path / "out", tmp_path / "ref")
    _write(tmp_path / "out/hidden_states/hs_1.safetensors", _states(1))
    with pytest.raises(AssertionError, match="hs_1"):
        same_records(tmp_path / "out", tmp_path / "ref")
