"""Publish a dataset version for training: prepare it (content-addressed: an unchanged source reuses
its version) and emit `eagle3.dataset.published` with `eagle3.training: wanted`, which the
`eagle3-train-on-publish` automation (prefect.yaml, on the pipeline deployment) answers by starting
a pipeline run with the event's config. For data jobs that publish without training themselves:

    PREFECT_API_URL=http://<server>:4200/api python -m deployments.publish --config configs/tiny-cpu.yaml [--set k=v ...]

The pipeline and refresh flows emit the same event with `eagle3.training: in-run` (they train what
they publish), which the automation ignores.
"""

from __future__ import annotations

import argparse
import json

from prefect.events.worker import EventsWorker

from eagle3_pipeline.core.config import PipelineConfig, load_config
from eagle3_pipeline.data.tokenized import PrepareResult
from eagle3_pipeline.pipeline.stages import stage_prepare
from tasks.stage_tasks import publish_dataset_event


def publish(config: PipelineConfig, log=print) -> PrepareResult:
    """Prepare `config`'s dataset and announce the version; returns the prepare record."""
    prep = stage_prepare(config, log=log)
    publish_dataset_event(config, prep, training="wanted")
    EventsWorker.drain_all()  # the event leaves before this process does
    return prep


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key.sub=value")
    args = ap.parse_args(argv)
    prep = publish(load_config(args.config, args.overrides))
    print(json.dumps(prep.model_dump(mode="json", include={"version", "dir", "rows_out", "tokens"})))


if __name__ == "__main__":  # pragma: no cover
    main()
