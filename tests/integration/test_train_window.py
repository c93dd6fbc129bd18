"""Training from a capture window, for real: speculators' trainer (train_draft's child) reads its train rows from
a window of 2 shards (train/window.py) while a capture process, its own process, publishes the tiny extraction's
records into it shard by shard, blocking while the window is full. Checked: the store never held more than the
window, every shard was published and released after a step checkpoint covered it, the trainer took exactly the
batches the window sampler plans for every train row (so every row was trained on once), no row was dropped, and
the draft learned (loss down, validation on the stored rows). The τ comparison with offline through the pipeline
(`train.mode: window`) is not built yet (docs/decisions/capture-window.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.core.config import TargetConfig, TrainConfig
from eagle3_pipeline.train.job import WindowSource
from eagle3_pipeline.train.stage import train_draft
from eagle3_pipeline.train.window import ShardWindow
from eagle3_pipeline.train.window_sampler import WindowSampler

CAPTURE = textwrap.dedent("""
    import json, shutil, sys
    from pathlib import Path
    from eagle3_pipeline.records.contracts import record_name
    from eagle3_pipeline.train.window import ShardWindow
    window_dir, records, plan = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    w = ShardWindow(window_dir, max_shards=2)
    for key, rows in plan:
        nbytes = sum((records / record_name(r)).stat().st_size for r in rows)
        w.reserve(key, nbytes, wait_s=600, poll_s=0.05)
        d = w.shard_dir(key)
        d.mkdir(parents=True)
        for r in rows:
            shutil.copyfile(records / record_name(r), d / record_name(r))
        w.publish(key, nbytes)
    w.close()
""")


@pytest.fixture(scope="module")
def inputs(tiny_config, tiny_target, prepared, extracted):
    from eagle3_pipeline.pipeline.stages import stage_vocab

    voc = stage_vocab(tiny_config, prepared, extracted.version, log=lambda _: None)
    return SimpleNamespace(version=extracted.version, vocab_dir=Path(voc.dir), target=TargetConfig(model=str(tiny_target)))


def test_training_from_a_window_filled_by_a_capture_process(inputs, tmp_path):
    from eagle3_pipeline.data.tokenized import load_tokenized

    cfg = TrainConfig(epochs=1, lr=1e-2, max_seq_len=512, draft_layers=1, ttt_steps=3, attention="sdpa",
                      device="cpu", val_ratio=0.15, timeout_s=900, num_workers=0)
    lengths = [int(x) for x in load_tokenized(inputs.version.tokenized_dir)["seq_len"]]
    n_train = int(len(lengths) * (1 - cfg.val_ratio))
    per = max(1, -(-n_train // 6))  # ~6 shards of the train rows
    plan = [(f"shard-{i:03d}", list(range(s, min(s + per, n_train)))) for i, s in enumerate(range(0, n_train, per))]
    expected = len(WindowSampler(ShardWindow(tmp_path / "planned", 2), lengths, cfg.max_seq_len, seed=cfg.seed,
                                 plan=plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cap = subprocess.Popen([sys.executable, "-c", CAPTURE, str(tmp_path / "window"),
                            str(inputs.version.hidden_states_dir), json.dumps(plan)], env=env)
    lines: list[str] = []
    try:
        res = train_draft(cfg, inputs.target, inputs.version, inputs.vocab_dir, tmp_path / "train", log=lines.append,
                          online=WindowSource(dir=str(tmp_path / "window"), max_shards=2, plan=plan, wait_s=600))
    finally:
        assert cap.wait(600) == 0
    st = ShardWindow(tmp_path / "window", 2).state()
    print(f"window: {len(plan)} shards of {per} rows, peak {st.peak_shards} shards / {st.peak_bytes} bytes of "
          f"{st.released_bytes} released; {res.steps} steps; loss {res.first_loss} -> {res.final_loss}, "
          f"val {res.val_loss}")
    assert res.mode == "window" and res.export_checked
    assert st.peak_shards <= 2 and st.shards == {} and st.published == st.released == len(plan)
    assert st.peak_bytes < st.released_bytes  # the window held less than the train rows' records at any time
    assert res.steps == expected  # every batch the sampler packs from every train row, once
    steps = [json.loads(x) for x in Path(res.metrics).read_text().splitlines()]
    assert all(not (d.get("error_records") or 0) for d in steps if d.get("kind") == "train_step")
    assert res.final_loss < res.first_loss and res.val_loss is not None
