"""Chaos: SIGKILL the trainer child at seeded random moments, then gate and resume.

Trains speculators' EAGLE-3 draft (train_draft, the child in eagle3_pipeline.train.worker) on the small
run's extracted data (tests/conftest.py `small_reference`; 2 epochs of a few packed rows). A reference
run gives the step count. Each trial starts a fresh checkpoint dir and SIGKILLs the trainer child at
a seeded random moment of one of three phases, in turn:
  steps       a random delay after its "start" event, among the optimizer steps (EAGLE3_TEST_STEP_DELAY_S
              paces the steps, so the delay is always shorter than the run on any machine);
  save        a random delay (0-0.1 s) after "Saving checkpoint to .../0": in or just after the save;
  validation  a random delay (0-0.1 s) after "Checkpoint saved to .../0": the checkpoint is complete
              but its epoch's validation has not run or not finished (the case that found a bug:
              see train._unfinished_epoch).
After the kill: the gpu-gate leaves no process of the trial alive; then the resume finishes with the
reference's step count and epochs, one metrics line per step and one validation per epoch, a
checkpoint_best that loads and passes export_check, and no temporary file or half-written epoch
checkpoint under its final name.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.core.proc import ChildFailed
from eagle3_pipeline.train.export import export_check
from eagle3_pipeline.train.stage import CKPT_FILES, train_draft
from eagle3_pipeline.train.worker import STEP_DELAY_ENV
from tests.helpers.chaos import TRAINER_TRIALS, DelayedKill, child_running, gate_after_kill, trial_rng
from tests.helpers.store import temporaries

TRAINER = "eagle3_pipeline.train.worker"
STEP_DELAY_S = 0.5

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def inputs(small_reference):
    from eagle3_pipeline.core.config import TargetConfig
    from eagle3_pipeline.pipeline.stages import stage_vocab

    ref = small_reference
    voc = stage_vocab(ref.cfg, ref.prep, ref.version, log=lambda _: None)
    return SimpleNamespace(cfg=ref.cfg.train, target=TargetConfig(model=ref.cfg.target.model), version=ref.version,
                           vocab_dir=Path(voc.dir))


def _train(inputs, out: Path, log):
    return train_draft(inputs.cfg, inputs.target, inputs.version, inputs.vocab_dir, out, log=log)


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    res = _train(inputs, tmp_path_factory.mktemp("train-ref") / "run", log=lambda _: None)
    assert res.epochs_done == inputs.cfg.epochs and res.steps >= 4
    return res


PHASES = {  # phase -> (the line that starts its clock, the longest delay after it)
    "steps": ("train: start", lambda ref: 0.9 * ref.steps * STEP_DELAY_S),
    "save": ("Saving checkpoint to ", lambda ref: 0.1),
    "validation": ("Checkpoint saved to ", lambda ref: 0.1),
}


@pytest.mark.parametrize("trial", range(TRAINER_TRIALS))
def test_trainer_killed(trial, inputs, reference, tag, tmp_path, monkeypatch):
    rng = trial_rng("trainer", trial)
    phase = list(PHASES)[trial % len(PHASES)]
    trigger, longest = PHASES[phase]
    delay = rng.uniform(0.0, longest(reference))
    out = tmp_path / "run"
    save = out / "checkpoints"
    print(f"trial {trial}: SIGKILL the trainer child {delay:.2f}s after {trigger!r} ({phase})")

    killer = DelayedKill(child_running(TRAINER, tag), delay)
    lines: list[str] = []
    monkeypatch.setenv("EAGLE3_CHILD_OUTPUT", "all")  # the triggers are the trainer library's own lines (proc.py)

    def log(line: str) -> None:  # the first save is epoch 0's: epoch 1 still follows it
        lines.append(line)
        if trigger in line:
            killer.trigger.set()

    monkeypatch.setenv(STEP_DELAY_ENV, str(STEP_DELAY_S))
    try:
        with pytest.raises(ChildFailed, match="code -9"):
            _train(inputs, out, log)
    finally:
        killer.stop()
    monkeypatch.delenv(STEP_DELAY_ENV)
    assert killer.killed is not None
    steps_before = sum(x.startswith("train: step ") for x in lines)
    epochs_saved = sorted(d.name for d in save.iterdir() if d.name.isdigit()) if save.exists() else []
    print(f"trial {trial}: killed after {steps_before} logged steps, "
          f"{sum(x.startswith('train: validation') for x in lines)} validations; epoch dirs: "
          + ", ".join(f"{e} ({'complete' if all((save / e / f).exists() for f in CKPT_FILES) else 'incomplete'})"
                      for e in epochs_saved))
    assert not (out / "train_result.json").exists()  # nothing claims the killed attempt finished
    gate_after_kill(tag)

    lines = []
    res = _train(inputs, out, lines.append)
    print(f"trial {trial}: resumed from epoch {res.resumed_from_epoch}; "
          + "; ".join(x for x in lines if "moved to" in x))
    assert (res.steps, res.epochs_done) == (reference.steps, reference.epochs_done)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train_step"] == list(range(res.steps))
    assert [r["epoch"] for r in rows if r["kind"] == "val"] == list(range(res.epochs_done)), \
        "an epoch was never validated: its checkpoint was resumed from although validation had not run"
    assert res.export_checked and res.checkpoint_best.is_symlink()
    export_check(res.checkpoint_best, inputs.vocab_dir, Path(inputs.target.model))
    from safetensors.torch import load_file

    weights = load_file(str(res.checkpoint_best / "model.safetensors"))
    assert {"fc.weight", "d2t", "t2d"} <= set(weights)
    for e in range(res.epochs_done):
        assert all((save / str(e) / f).exists() for f in CKPT_FILES), f"epoch {e} checkpoint incomplete"
    assert temporaries(out) == []
