"""Chaos: one node of a two-node train set dies mid-run (SIGKILL to its torchrun agent and its rank: a lost node).

Two agents on 127.0.0.1 (`train.nodes=2`, one gloo rank each) train the session's tiny draft with a step checkpoint
every CHECKPOINT_EVERY optimizer steps. Once the set has logged a seeded number of steps, node 1's agent and its
worker are killed. The set ends as a whole (node 0's rank loses its peer, the launcher ends node 0's agent) and the
attempt fails; the gpu-gate leaves nothing of it. The next attempt resumes from the last step checkpoint, losing at
most CHECKPOINT_EVERY steps, and finishes with the step count of a clean run, one metrics line per step.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.core.config import TargetConfig
from eagle3_pipeline.core.proc import ChildFailed
from eagle3_pipeline.train.stage import train_draft
from eagle3_pipeline.train.worker import STEP_DELAY_ENV
from tests.helpers.chaos import gate_after_kill, trial_rng
from tests.helpers.store import temporaries

CHECKPOINT_EVERY = 3
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def inputs(tiny_config, tiny_target, prepared, extracted):
    from eagle3_pipeline.pipeline.stages import stage_vocab

    voc = stage_vocab(tiny_config, prepared, extracted.version, log=lambda _: None)
    # packed rows of 256 tokens (the small run's, tests/helpers/store.small_overrides): half the step compute of
    # 512 (two ranks share one core here); 1 epoch of the tiny data still holds far more than max_steps
    cfg = tiny_config.train.model_copy(update={"nodes": 2, "world_size": 1, "epochs": 1, "max_steps": 14,
                                               "max_seq_len": 256, "checkpoint_every_steps": CHECKPOINT_EVERY})
    return SimpleNamespace(cfg=cfg, target=TargetConfig(model=str(tiny_target)), version=extracted.version,
                           vocab_dir=Path(voc.dir))


def _node_agent(lines: list[str], node: int) -> int | None:
    """The pid of node `node`'s agent, from the local launcher's line (train/nodes.py)."""
    for x in lines:
        if f"train nodes: node {node} of " in x and "agent pid " in x:
            return int(x.split("agent pid ")[1].split()[0])
    return None


def _kill_node(pid: int) -> list[int]:
    import psutil

    agent = psutil.Process(pid)
    procs = [agent, *agent.children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    return [p.pid for p in procs]


@pytest.mark.parametrize("trial", range(2))
def test_a_lost_node_costs_at_most_the_checkpoint_interval(trial, inputs, tag, tmp_path, monkeypatch):
    rng = trial_rng("train-nodes", trial)
    kill_after = rng.randint(CHECKPOINT_EVERY + 1, 10)  # logged steps before node 1 dies
    out = tmp_path / "run"
    lines: list[str] = []
    killed: list[int] = []
    at: list[float] = []  # when node 1 died

    def killer():
        metrics = out / "metrics.jsonl"
        while not killed:
            n = sum('"train_step"' in x for x in metrics.read_text().splitlines()) if metrics.exists() else 0
            pid = _node_agent(lines, 1)
            if n >= kill_after and pid:
                killed.extend(_kill_node(pid))
                at.append(time.monotonic())
                return
            time.sleep(0.05)

    monkeypatch.setenv(STEP_DELAY_ENV, "0.3")  # paces the steps so that the kill lands mid-run on any machine
    t = threading.Thread(target=killer, daemon=True)
    t.start()
    with pytest.raises(ChildFailed):
        train_draft(inputs.cfg, inputs.target, inputs.version, inputs.vocab_dir, out, log=lines.append)
    ended = time.monotonic()
    t.join(timeout=5)
    monkeypatch.delenv(STEP_DELAY_ENV)
    assert killed, "node 1 was never killed"
    done = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"train_step"' in x]
    print(f"killed node 1 ({killed}) after {len(done)} logged steps (last {done[-1]}); the set ended "
          f"{ended - at[0]:.1f}s later")
    assert ended - at[0] < 120  # node 0 does not wait out a timeout for its lost peer
    gate_after_kill(tag)

    res = train_draft(inputs.cfg, inputs.target, inputs.version, inputs.vocab_dir, out, log=lines.append)
    lost = len(done) - res.resumed_from_step
    print(f"resumed from step {res.resumed_from_step}: {lost} steps trained again")
    assert res.resumed_from_step > 0 and res.resumed_from_step % CHECKPOINT_EVERY == 0
    assert 0 <= lost <= CHECKPOINT_EVERY
    assert res.steps == inputs.cfg.max_steps and res.nodes == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train_step"] == list(range(res.steps))
    assert res.export_checked and res.checkpoint_best.is_symlink()
    assert temporaries(out) == [] and not list((out / "checkpoints").glob(".staging-*"))
