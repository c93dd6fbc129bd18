"""Extract a slice with the target's forward corrupted upstream of every record (tests/helpers/forward_corruption.py),
for measuring the per-row signal (verify/row_signal.py) offline: `python bench/row_signal_extract.py CONFIG MODEL
OUT_JSON EVERY MODES LIMIT [set ...]` writes the version's directory, the tokenized dataset and which rows were
corrupted in which mode to OUT_JSON. Heavy (starts the vLLM CPU engine): run it under /work/heavy."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]


def main(config: str, model: str, out: str, every: str, modes: str, limit: str, *sets: str) -> None:
    import datasets

    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_extract, stage_preflight, stage_prepare
    from tests.helpers.forward_corruption import EVERY_ENV, MODE_ENV, corrupted, mode_of

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    os.environ[EVERY_ENV], os.environ[MODE_ENV] = every, modes
    base = load_config(ROOT / config)
    per = int(limit) // len(base.prepare.sources)
    srcs = ", ".join(f"{{path: '{s.path}', limit: {per}" + (f", format: {s.format}" if s.format else "") +
                     (f", on_damaged: {s.on_damaged}" if getattr(s, "on_damaged", None) else "") + "}"
                     for s in base.prepare.sources)
    cfg = load_config(ROOT / config, [f"store={Path(out).parent / 'store'}", f"target.model={model}",
                                      f"prepare.sources=[{srcs}]", "prepare.heldout_rows=4",
                                      "extract.connector_module=tests.helpers.forward_corruption",
                                      "extract.connector_name=ForwardCorruptionConnector", *sets])
    prep = stage_prepare(cfg, log=print)
    version = plan_extract(cfg, prep, stage_preflight(cfg, prep, log=print))
    stage_extract(cfg, version, log=print)
    tok = datasets.load_from_disk(prep.tokenized)
    bad = {i: mode_of(ids, modes) for i, ids in enumerate(tok["input_ids"]) if corrupted(ids, int(every))}
    Path(out).write_text(json.dumps({"version": str(version.path), "tokenized": prep.tokenized, "rows": len(tok),
                                     "bad": bad, "config": config, "model": model}, indent=1))
    print(f"{len(bad)} of {len(tok)} rows corrupted: {bad}")


if __name__ == "__main__":
    main(*sys.argv[1:])
