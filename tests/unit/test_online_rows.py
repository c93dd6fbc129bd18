"""train/online_data.row_problems: every row the online server sends is checked before training on it
(the per-record checks that need no other record), and ServerFileTransfer refuses a bad one."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import save_file

from eagle3_pipeline.train.online_data import ServerFileTransfer, row_problems

T, L, H = 12, 4, 32


def _row():
    torch.manual_seed(0)
    return {"hidden_states": torch.randn(T, L, H), "token_ids": torch.arange(T)}


@pytest.mark.parametrize("corrupt, fragment", [
    (lambda r: r["hidden_states"].__setitem__((3, 1, 5), float("nan")), "non-finite values (first at token 3, layer slot 1)"),
    (lambda r: r["hidden_states"].__setitem__((7, 2), 0.0), "token 7 is all zeros in layer slot 2"),
    (lambda r: r["hidden_states"].__setitem__((slice(None), 1), r["hidden_states"][:, 0]), "layer slots 0 and 1 are identical"),
    (lambda r: r.__setitem__("hidden_states", r["hidden_states"][:, :3]), "expected [T, L, H] = [12, 4, 32], found [12, 3, 32]"),
    (lambda r: r.__setitem__("hidden_states", r["hidden_states"][0]), "found [4, 32]"),  # the `[0]` bug
])
def test_each_corruption_is_named(corrupt, fragment):
    row = _row()
    assert row_problems(row, L, H) == []
    corrupt(row)
    problems = row_problems(row, L, H)
    assert any(fragment in p for p in problems), problems


def test_the_transfer_refuses_a_bad_row_and_the_check_is_cheap(tmp_path):
    row = _row()
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    save_file({"hidden_states": row["hidden_states"].to(torch.bfloat16), "token_ids": row["token_ids"]}, str(good))
    hs = row["hidden_states"].clone()
    hs[5] = 0
    save_file({"hidden_states": hs.to(torch.bfloat16), "token_ids": row["token_ids"]}, str(bad))
    tr = ServerFileTransfer(tmp_path, wait_s=5, layers=L, hidden_size=H)
    assert tr.get_generated({"hidden_states_path": str(good)})["hidden_states"].shape == (T, L, H)
    with pytest.raises(ValueError, match=r"online row bad.safetensors from the server fails the per-row checks: token 5"):
        tr.get_generated({"hidden_states_path": str(bad)})
    big = {"hidden_states": torch.randn(2048, 4, 1024), "token_ids": torch.arange(2048)}
    t0 = time.perf_counter()
    assert row_problems(big, 4, 1024) == []
    print(f"row_problems on a [2048, 4, 1024] row: {1000 * (time.perf_counter() - t0):.1f} ms")
