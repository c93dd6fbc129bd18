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


def _checks(tmp_path, tiny_target, identity: dict | None, **on):
    from eagle3_pipeline.train.job import RowChecksSpec
    from eagle3_pipeline.train.online_data import RowChecks

    spec = RowChecksSpec(model_dir=str(tiny_target), norm_eps=1e-5, atol=0.005, rtol=0.008, stol=0.02,
                         layer_ids=[2, 4, 5, 8], storage_dtype="bf16", identity=identity, **on,
                         rejected_path=str(tmp_path / "rejected.jsonl"), flagged_path=str(tmp_path / "flagged.jsonl"),
                         flagged_dir=str(tmp_path / "flagged" / "hidden_states"))
    return RowChecks(spec)


def _layered_row(seed: int, T: int, H: int):
    """A row whose slots relate like layers: norms grow with depth, each slot near the next."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(T, H, generator=g)
    slots = [base * (1 + 0.6 * k) + 0.3 * k * torch.randn(T, H, generator=g) for k in range(4)]
    return torch.stack(slots, dim=1).to(torch.bfloat16)  # [T, 4, H]


def _fingerprint_of(checks, hs):
    """vLLM's top-2 next-token scores as the extract engine would write them, from the row's final slot, and the
    server engine's state sketch of the row's states."""
    from eagle3_pipeline.engine import state_sketch as sk
    from eagle3_pipeline.records.contracts import FP_IDS_KEY, FP_LOGPROBS_KEY

    f = checks.final
    x = hs[:, -1].float()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + f.eps) * f.norm
    top = (n @ f.head.float().T).topk(2, dim=-1)
    return {FP_IDS_KEY: top.indices, FP_LOGPROBS_KEY: top.values,
            sk.KEY: sk.project(sk.stored(hs, "bf16"), hs.shape[-1])}


def test_every_online_row_is_judged_against_the_target(tmp_path, tiny_target):
    """Issue 30, online mode: RowChecks passes a clean row, rejects one whose final layer disagrees with the
    target's logits at one token (naming it; a later clean answer clears it), rejects one whose aux state of
    one token differs from the server engine's state sketch (or that came without a sketch), and holds a row
    whose aux slots were permuted before the sketch, writing its record for the stage to confirm with the
    streamed reference."""
    import json

    import numpy as np
    from safetensors.torch import load_file

    from eagle3_pipeline.checks.layer_identity import learn, row_features
    from eagle3_pipeline.train.online_data import FLAGGED, SampleUnavailable

    H = json.loads((tiny_target / "config.json").read_text())["hidden_size"]
    med, scale = learn(np.stack([row_features(_layered_row(s, 40, H)) for s in range(12)]))
    checks = _checks(tmp_path, tiny_target, {"median": med.tolist(), "scale": scale.tolist(), "max_z": 20.0})
    hs = _layered_row(99, 40, H)
    fp = _fingerprint_of(checks, hs)
    row = {"hidden_states": hs, "token_ids": torch.arange(40)}
    assert checks.judge(7, row, fp) is row
    bad = hs.clone()
    bad[31, -1] = hs[5, -1]  # one token's final state from another position
    with pytest.raises(ValueError, match=r"online row 7 \(40 tokens\): final layer disagrees with the target's "
                                         r"logits at 1 of 40 tokens \(positions \[31\]\)"):
        checks.judge(7, {"hidden_states": bad, "token_ids": torch.arange(40)}, fp)
    assert checks.rejected == {7: checks.rejected[7]}
    assert checks.judge(7, row, fp) is row and checks.rejected == {}  # asked again, right: not a rejected row
    kinds = [json.loads(ln)["kind"] for ln in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert kinds == ["rejected", "passed"]
    swapped = hs.clone()
    swapped[:, [0, 1]] = hs[:, [1, 0]]
    held = checks.judge(9, {"hidden_states": swapped, "token_ids": torch.arange(40)}, _fingerprint_of(checks, swapped))
    assert isinstance(held, SampleUnavailable) and held.reason.startswith(FLAGGED), held
    assert "aux layers do not relate like layers [2, 4, 5, 8]" in held.reason
    rec = load_file(str(tmp_path / "flagged" / "hidden_states" / "hs_9.safetensors"))
    assert rec["hidden_states"].shape == (40, 4, H)
    assert json.loads((tmp_path / "flagged.jsonl").read_text())["row"] == 9
    with pytest.raises(ValueError, match="no fingerprint"):
        checks.judge(11, row, None)
    aux = hs.clone()
    aux[17, 1] = hs[3, 1]  # one token's second aux slot from another position, the final layer right
    with pytest.raises(ValueError, match=r"online row 12 \(40 tokens\): states differ from the ones the target "
                                         r"computed at 1 token-layer pairs \(first: position 17, layer slot 1;"):
        checks.judge(12, {"hidden_states": aux, "token_ids": torch.arange(40)}, fp)
    with pytest.raises(ValueError, match="the server wrote no state sketch"):
        checks.judge(13, row, {k: v for k, v in fp.items() if k != "state_sketch"})


def test_online_checks_are_skipped_one_by_one(tmp_path, tiny_target):
    """verify.allow_skip naming the fingerprint leaves the state sketch on (and the other way round): a row with
    one aux state from another position is still rejected without fingerprints, and a row whose final layer
    disagrees is still rejected without sketches; a fingerprint scoring only some tokens is refused."""
    import json

    from eagle3_pipeline.records.contracts import FP_IDS_KEY

    H = json.loads((tiny_target / "config.json").read_text())["hidden_size"]
    full = _checks(tmp_path, tiny_target, None)
    hs = _layered_row(5, 30, H)
    fp = _fingerprint_of(full, hs)
    no_fp = _checks(tmp_path, tiny_target, None, fingerprint=False)
    assert no_fp.final is None
    row = {"hidden_states": hs, "token_ids": torch.arange(30)}
    assert no_fp.judge(1, row, {"state_sketch": fp["state_sketch"]}) is row
    aux = hs.clone()
    aux[9, 0] = hs[2, 0]
    with pytest.raises(ValueError, match=r"states differ .* position 9, layer slot 0"):
        no_fp.judge(2, {"hidden_states": aux, "token_ids": torch.arange(30)}, {"state_sketch": fp["state_sketch"]})
    no_sketch = _checks(tmp_path, tiny_target, None, sketch=False)
    assert no_sketch.judge(3, row, {k: v for k, v in fp.items() if k != "state_sketch"}) is row
    bad = hs.clone()
    bad[11, -1] = hs[4, -1]
    with pytest.raises(ValueError, match=r"final layer disagrees .*positions \[11\]"):
        no_sketch.judge(4, {"hidden_states": bad, "token_ids": torch.arange(30)}, fp)
    part = dict(fp)
    part[FP_IDS_KEY] = fp[FP_IDS_KEY].clone()
    part[FP_IDS_KEY][1:] = -1
    with pytest.raises(ValueError, match=r"its fingerprint scores 1 of 30 tokens"):
        full.judge(5, row, part)
