"""The real trainer on the session's tiny extraction, for the tests that compare topologies (nodes, sharding):
`train_inputs` (the version, its draft vocabulary and the target) and `train_run` (train_draft into a directory,
with its log lines and its metrics.jsonl split into train steps and validations)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from eagle3_pipeline.core.config import TargetConfig, TrainConfig
from eagle3_pipeline.pipeline.stages import stage_vocab
from eagle3_pipeline.train.stage import train_draft


def train_inputs(tiny_config, tiny_target: Path, prepared, extracted) -> SimpleNamespace:
    voc = stage_vocab(tiny_config, prepared, extracted.version, log=lambda _: None)
    return SimpleNamespace(version=extracted.version, vocab_dir=Path(voc.dir), target=TargetConfig(model=str(tiny_target)))


def train_run(inputs: SimpleNamespace, cfg: TrainConfig, out: Path) -> SimpleNamespace:
    lines: list[str] = []
    res = train_draft(cfg, inputs.target, inputs.version, inputs.vocab_dir, out, log=lines.append)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(res=res, lines=lines, steps=[s for s in steps if s["kind"] == "train_step"],
                           val=[s for s in steps if s["kind"] == "val"])
