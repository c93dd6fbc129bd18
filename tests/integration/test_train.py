"""train stage on CPU, for real: speculators' EAGLE-3 trainer in a child process on the session's
extracted data (tests/conftest.py: the tiny target, prepared with its chat template, hidden states
extracted by vLLM) and the vocab stage's d2t/t2d.

One module-scoped training run (2 epochs on the extraction's first 192 rows, ≈ 34 optimizer steps of
512-token packed rows) is shared by the checks of metrics, checkpoint, export check, resume and serving; the
killed-training test (on the first 96 rows: ~9 steps an epoch) and the untrained draft run children of
their own.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3_pipeline.core.config import EvaluateConfig, TargetConfig, TrainConfig
from eagle3_pipeline.core.proc import ChildFailed
from eagle3_pipeline.records.contracts import to_record
from eagle3_pipeline.train.export import ExportCheckError, export_check
from eagle3_pipeline.train.stage import CKPT_FILES, make_untrained_draft, train_draft
from eagle3_pipeline.train.worker import KILL_ENV


@pytest.fixture(scope="module")
def inputs(tiny_config, tiny_target, prepared, extracted):
    from eagle3_pipeline.pipeline.stages import stage_vocab

    voc = stage_vocab(tiny_config, prepared, extracted.version, log=lambda _: None)
    assert voc.coverage > 0.9
    assert Path(voc.dir) == extracted.version.vocab_dir(tiny_config.vocab.draft_vocab_size).resolve()
    return SimpleNamespace(version=extracted.version, tokenized=extracted.tokenized,
                           hidden_states=extracted.hidden_states, layer_ids=extracted.layer_ids,
                           vocab_dir=Path(voc.dir), k=voc.draft_vocab_size, model_dir=tiny_target,
                           target=TargetConfig(model=str(tiny_target)), prepared=prepared)


def _cfg(**kw) -> TrainConfig:
    base = dict(epochs=2, lr=1e-2, max_seq_len=512, draft_layers=1, ttt_steps=3, attention="sdpa",
                device="cpu", val_ratio=0.15, timeout_s=900)
    return TrainConfig(**{**base, **kw})


def _first_rows(inputs, rows: int, out: Path):
    """The shared extraction cut to its first `rows` rows (a tokenized cut and links to their records), for a
    test whose assertions do not depend on the amount of data: fewer optimizer steps per epoch."""
    import datasets

    from eagle3_pipeline.records.contracts import record_name
    from tests.helpers.version import relocated

    tok = out / "tokenized"
    datasets.load_from_disk(str(inputs.tokenized)).select(range(rows)).save_to_disk(str(tok))
    version = relocated(inputs.version, out / "extract", tokenized_dir=tok)
    version.hidden_states_dir.mkdir(parents=True)
    for i in range(rows):
        (version.hidden_states_dir / record_name(i)).symlink_to(inputs.version.record_path(i))
    return version


@pytest.fixture(scope="module")
def trained(inputs, tmp_path_factory):
    """The shared run, on the first 192 rows of the extraction (~17 steps an epoch)."""
    out = tmp_path_factory.mktemp("train-run")
    version = _first_rows(inputs, 192, tmp_path_factory.mktemp("cut"))
    lines: list[str] = []
    t0 = time.monotonic()
    res = train_draft(_cfg(), inputs.target, version, inputs.vocab_dir, out, log=lines.append)
    return SimpleNamespace(res=res, out=out, lines=lines, seconds=time.monotonic() - t0, version=version)


def test_training_reduces_loss_and_writes_metrics(trained):
    res = trained.res
    rows = [json.loads(x) for x in (trained.out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train_step"]
    vals = [r for r in rows if r["kind"] == "val"]
    assert len(steps) == res.steps >= 6 and len(vals) == 2
    assert all(len(r["acc"]) == 3 and r["loss"] is not None for r in steps)
    first = np.mean([r["loss"] for r in steps[:2]])
    last = np.mean([r["loss"] for r in steps[-2:]])
    assert last < 0.8 * first, f"loss did not decrease: {first:.3f} -> {last:.3f}"
    assert vals[-1]["loss"] < vals[0]["loss"]
    assert res.tokens_per_s > 0 and res.tokens > 0
    assert any("tok/s" in x for x in trained.lines)  # events reached the parent's log
    assert (trained.out / "train.log").exists()


def test_checkpoint_is_a_servable_speculators_draft(trained, inputs):
    best = trained.res.checkpoint_best
    assert best.is_symlink() and (best / "config.json").exists()
    from safetensors import safe_open

    with safe_open(str(best / "model.safetensors"), framework="pt") as f:
        assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(f.keys())
    conf = json.loads((best / "config.json").read_text())
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert conf["draft_vocab_size"] == inputs.k
    export_check(best, inputs.vocab_dir, inputs.model_dir)


def test_export_check_catches_altered_d2t(trained, inputs, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(trained.res.checkpoint_best, bad)
    w = load_file(str(bad / "model.safetensors"))
    w["d2t"] = w["d2t"].clone()
    w["d2t"][7] += 1
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ExportCheckError, match="d2t differs .* index 7"):
        export_check(bad, inputs.vocab_dir, inputs.model_dir)
    # and a draft whose lm_head no longer matches the target's rows
    w = load_file(str(trained.res.checkpoint_best / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"].clone()
    w["lm_head.weight"][3] *= 2
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ExportCheckError, match="lm_head.weight differs .* row 3"):
        export_check(bad, inputs.vocab_dir, inputs.model_dir)


def test_resume_continues_from_last_epoch(trained, inputs, tmp_path):
    """Resumes a copy of the shared run (its checkpoint links are relative), so the shared run stays what
    the other tests read."""
    out = tmp_path / "run"
    shutil.copytree(trained.out, out, symlinks=True)
    lines: list[str] = []
    res = train_draft(_cfg(epochs=3), inputs.target, trained.version, inputs.vocab_dir, out, log=lines.append)
    assert res.resumed_from_epoch == 1 and res.epochs_done == 3
    assert trained.res.steps < res.steps < trained.res.steps * 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train_step"] == list(range(res.steps))
    export_check(res.checkpoint_best, inputs.vocab_dir, inputs.model_dir)


def test_compute_dtype_is_reported_and_bf16_trains_on_any_cpu(trained, inputs, tmp_path):
    """The shared run used auto (this CPU's choice, named in the start line); an explicit bfloat16 run
    (what GPUs and CPUs with native bf16 use) trains a few steps here too, with finite, falling loss."""
    from eagle3_pipeline.train.worker import compute_dtype

    auto = str(compute_dtype(_cfg())).removeprefix("torch.")
    assert any(x.startswith("train: start") and f"{auto} compute" in x for x in trained.lines), trained.lines[:3]
    lines: list[str] = []
    res = train_draft(_cfg(epochs=1, max_steps=4, compute_dtype="bfloat16"), inputs.target, inputs.version,
                      inputs.vocab_dir, tmp_path / "bf16", log=lines.append)
    assert any(x.startswith("train: start") and "bfloat16 compute" in x for x in lines), lines[:3]
    rows = [json.loads(x) for x in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train_step"]
    assert res.steps == len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    export_check(res.checkpoint_best, inputs.vocab_dir, inputs.model_dir)


def test_untrained_draft_has_same_architecture(trained, inputs, tmp_path):
    out = make_untrained_draft(inputs.target, inputs.version, inputs.vocab_dir, tmp_path / "untrained",
                               _cfg(), log=lambda _: None)
    export_check(out, inputs.vocab_dir, inputs.model_dir)
    a = json.loads((out / "config.json").read_text())
    b = json.loads((trained.res.checkpoint_best / "config.json").read_text())
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "norm_output"):
        assert a[key] == b[key]
    from safetensors.torch import load_file

    wa, wb = load_file(str(out / "model.safetensors")), load_file(str(trained.res.checkpoint_best / "model.safetensors"))
    assert set(wa) == set(wb) and all(wa[k].shape == wb[k].shape for k in wa)
    assert not torch.equal(wa["fc.weight"], wb["fc.weight"])


def test_incomplete_checkpoint_is_moved_aside_and_spec_guards_resume(tmp_path):
    from eagle3_pipeline.train.stage import _check_resume_spec, _move_incomplete_checkpoints

    save = tmp_path / "checkpoints"
    for epoch, files in ((0, ("config.json", "model.safetensors", "optimizer_state_dict.pt", "training_state.json")),
                         (1, ("config.json",))):
        (save / str(epoch)).mkdir(parents=True)
        for f in files:
            (save / str(epoch) / f).write_text("x")
    (save / "checkpoint_best").symlink_to("1")
    lines: list[str] = []
    _move_incomplete_checkpoints(save, lines.append)
    names = sorted(p.name for p in save.iterdir())
    assert names[0] == "0" and names[1].startswith("1.incomplete-") and len(names) == 2
    assert "incomplete" in lines[0]
    spec = {"target": "t", "aux_layer_ids": [2, 4, 5], "d2t_sha256": "a"}
    _check_resume_spec(tmp_path, save, spec)
    _check_resume_spec(tmp_path, save, spec)  # same draft: fine
    with pytest.raises(ValueError, match="d2t_sha256"):
        _check_resume_spec(tmp_path, save, {**spec, "d2t_sha256": "b"})


@pytest.mark.parametrize("val_lines, best, trained_again", [
    ([(0, 5.0)], "0", True),                 # epoch 1 saved, never validated (killed in between)
    ([(0, 5.0), (1, 4.0)], "0", True),       # validated as the new best, checkpoint_best not moved yet
    ([(0, 5.0), (1, 6.0)], "0", False),      # validated, not better: nothing left to do for epoch 1
    ([(0, 5.0), (1, 4.0)], "1", False),      # validated and made best: finished
])
def test_epoch_killed_between_save_and_validation_is_trained_again(tmp_path, val_lines, best, trained_again):
    """speculators saves an epoch's checkpoint before validating it and before moving checkpoint_best;
    a kill in between (found by the chaos suite) must not leave that epoch unvalidated on resume."""
    from eagle3_pipeline.train.stage import _move_incomplete_checkpoints

    save = tmp_path / "checkpoints"
    for epoch in (0, 1):
        (save / str(epoch)).mkdir(parents=True)
        for f in CKPT_FILES:
            (save / str(epoch) / f).write_text("x")
    (save / "checkpoint_best").symlink_to(best)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "val", "epoch": e, "loss": v}) + "\n"
                                                    for e, v in val_lines) + '{"kind": "train_st')  # a cut-off line
    lines: list[str] = []
    _move_incomplete_checkpoints(save, lines.append)
    names = sorted(p.name for p in save.iterdir() if not p.is_symlink())
    if not trained_again:
        assert names == ["0", "1"] and lines == []
    else:
        assert names[0] == "0" and names[1].startswith("1.incomplete-") and len(names) == 2
        assert "is complete but" in lines[0] and "not resumed from" in lines[0]
        assert os.readlink(save / "checkpoint_best") == "0"


def test_step_lines_reach_the_log_callback(trained):
    """The step lines the Prefect run logger gets (train_draft's `log`): step, epoch, loss, full-sequence
    accuracy per TTT step and throughput, at the extraction's cadence (progress.interval(): the first step, at
    most one every EAGLE3_PROGRESS_S seconds, and the last before each validation and the end);
    metrics.jsonl keeps every step."""
    import json
    import re

    from eagle3_pipeline.core.progress import interval

    pat = re.compile(r"^train: step (\d+)(?:/\d+)? epoch (\d+) loss (\d+\.\d{3}) acc\[(\d\.\d\d) (\d\.\d\d) (\d\.\d\d)\] "
                     r"(\d+) tok/s$")
    steps = [int(m.group(1)) for m in map(pat.match, trained.lines) if m]
    n = trained.res.steps
    assert steps[0] == 0 and steps[-1] == n - 1 and steps == sorted(set(steps)), steps
    # not one per step: the first, one per period, and the one before each validation and the end
    assert len(steps) <= 2 + trained.res.epochs_done + trained.seconds / interval(), (steps, trained.seconds)
    rows = [json.loads(x) for x in (trained.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train_step"] == list(range(n))
    assert any(x.startswith("train: validation epoch 1 loss ") for x in trained.lines)
    assert any(x.startswith("train: export check passed for ") for x in trained.lines)
    assert trained.res.export_checked


def _ckpt_complete(d: Path) -> bool:
    return d.is_dir() and all((d / f).exists() for f in CKPT_FILES)


def test_killed_training_resumes_from_last_complete_checkpoint(inputs, tmp_path, monkeypatch):
    """SIGTERM (preemption), SIGKILL mid-epoch (no chance to save anything), then SIGKILL in the middle
    of writing an epoch checkpoint; each rerun of train_draft resumes from the last *complete* epoch
    checkpoint, the metrics stay one line per step without gaps or duplicates, and the final draft
    passes export_check. On the first 96 rows (~9 steps an epoch instead of ~36): the kills need 4 steps an
    epoch, not the whole extraction."""
    out = tmp_path / "run"
    cfg = _cfg(epochs=3)
    args = (cfg, inputs.target, _first_rows(inputs, 96, tmp_path / "cut"), inputs.vocab_dir, out)
    save = out / "checkpoints"

    def metric_steps() -> list[int]:
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows if r["kind"] == "train_step"]

    # attempt 0: SIGTERM (a preemption) at the 2nd step: speculators saves `interrupted/` and returns as
    # if done; the attempt must fail anyway, and its partial save is never resumed from
    monkeypatch.setenv(KILL_ENV, "term:0:2")
    with pytest.raises(ChildFailed, match="training was interrupted"):
        train_draft(*args, log=lambda _: None)
    assert (save / "interrupted" / "model.safetensors").exists() and not (save / "0").exists()
    assert not (out / "train_result.json").exists()

    # attempt 1: starts afresh; killed after the 3rd step of epoch 1 (0-based): epoch 0's checkpoint is all there is
    monkeypatch.setenv(KILL_ENV, "step:1:3")
    lines: list[str] = []
    with pytest.raises(ChildFailed, match="exited with code -9"):
        train_draft(*args, log=lines.append)
    assert any("interrupted" in x and "moved to" in x for x in lines)
    assert any("resumed from epoch -1, step 0" in x for x in lines)
    assert _ckpt_complete(save / "0") and not (save / "1").exists()
    per_epoch = json.loads((save / "0" / "training_state.json").read_text())["global_step"]
    assert per_epoch >= 4
    assert metric_steps() == list(range(per_epoch + 3))

    # attempt 2: resumes from epoch 0, killed while writing epoch 1's checkpoint (weights on disk,
    # training_state.json not): a directory that looks like a checkpoint but is not complete
    monkeypatch.setenv(KILL_ENV, "save:1")
    lines = []
    with pytest.raises(ChildFailed, match="exited with code -9"):
        train_draft(*args, log=lines.append)
    assert any(f"resumed from epoch 0, step {per_epoch}" in x for x in lines)
    assert (save / "1" / "model.safetensors").exists() and not _ckpt_complete(save / "1")
    assert metric_steps() == list(range(2 * per_epoch))

    # attempt 3: the incomplete epoch 1 is moved aside, training resumes from epoch 0 and finishes
    monkeypatch.delenv(KILL_ENV)
    lines = []
    res = train_draft(*args, log=lines.append)
    assert any("is incomplete" in x and "not resumed from" in x for x in lines)
    assert any(f"resumed from epoch 0, step {per_epoch}" in x for x in lines)
    assert res.resumed_from_epoch == 0 and res.epochs_done == 3
    assert res.steps == 3 * per_epoch
    assert metric_steps() == list(range(res.steps))  # replayed steps replaced, nothing missing
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if r["kind"] == "val"] == [0, 1, 2]
    assert [p.name for p in save.iterdir() if p.name.startswith("1.incomplete-")]
    assert all(_ckpt_complete(save / str(e)) for e in range(3)) and res.checkpoint_last == save / "2"
    assert res.export_checked
    export_check(res.checkpoint_last, inputs.vocab_dir, inputs.model_dir)


@pytest.mark.timeout(900)
def test_trained_checkpoint_is_served_by_vllm(trained, inputs, tmp_path):
    """The exported checkpoint_best of train_draft, served by vLLM as the EAGLE-3 draft of the tiny
    target on held-out prompts: drafts are accepted (τ well above the untrained 1.0x), and greedy
    speculative decoding reproduces the target's own greedy tokens."""
    from eagle3_pipeline.evaluate.stage import evaluate_draft
    from eagle3_pipeline.pipeline.stages import heldout_prompts

    cfg = EvaluateConfig(num_prompts=8, num_speculative_tokens=3, max_tokens=32, check_lossless=True, timeout_s=600)
    r = evaluate_draft(cfg, inputs.target, trained.res.checkpoint_best, heldout_prompts(inputs.prepared, 8),
                       tmp_path / "eval", log=print)
    assert r.drafts > 0 and r.accepted_tokens > 0
    assert r.acceptance_length > 1.5, r
    assert r.per_position_acceptance[0] > 0.3
    assert r.lossless_mismatches == [], r.lossless_mismatches


def test_fp8_hidden_states_are_dequantized_for_training(inputs, tmp_path):
    """extract.storage_dtype=fp8 files (float8 + per-token scales) reach the draft as hidden states in the
    trainer's compute dtype, equal to the bf16 files' up to fp8 rounding: the train worker's loaders
    dequantize them."""
    from safetensors.torch import load_file, save_file

    from eagle3_pipeline.train.job import TrainJob
    from eagle3_pipeline.train.worker import _loaders

    fp8_dir = tmp_path / "hidden_states_fp8"
    fp8_dir.mkdir()
    for p in inputs.hidden_states.glob("hs_*.safetensors"):
        rec = load_file(str(p))
        save_file(to_record(rec["hidden_states"], rec["token_ids"], "fp8"), str(fp8_dir / p.name))
    hidden = json.loads((inputs.model_dir / "config.json").read_text())["hidden_size"]

    def first_batch(hs_dir: Path) -> dict:
        job = TrainJob(mode="train", train=_cfg(), target=inputs.target, tokenized_dir=str(inputs.tokenized),
                       hidden_states_dir=str(hs_dir), d2t_path="", t2d_path="", aux_layer_ids=[], out_dir="",
                       result_path="")
        train_loader, _ = _loaders(job, hidden, len(inputs.layer_ids) - 1)
        return next(iter(train_loader))

    a, b = first_batch(inputs.hidden_states), first_batch(fp8_dir)
    from eagle3_pipeline.train.worker import compute_dtype

    want = compute_dtype(_cfg())  # the trainer's dtype (fp32 on CPUs without native bf16)
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["hidden_states"].dtype == b["hidden_states"].dtype == want
    for key in ("hidden_states", "verifier_last_hidden_states"):
        x, y = a[key].float(), b[key].float()
        rel = ((x - y).norm() / x.norm()).item()
        assert rel < 0.05, f"{key}: relative error {rel:.4f} between bf16 and dequantized fp8"
