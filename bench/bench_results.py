"""How every bench hands its numbers to `bench/run_all.py`: `record(name, data)` writes
`$EAGLE3_BENCH_OUT/<name>.json` when that variable is set (run_all sets it) and does nothing otherwise,
so each script still runs on its own and prints its own table."""

from __future__ import annotations

import json
import os
from pathlib import Path


def record(name: str, data: dict) -> None:
    out = os.environ.get("EAGLE3_BENCH_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=2, default=float))


def spread(values: list[float]) -> dict:
    """Median with min and max of a bench's per-round values (what every ratio row shows)."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} \
        if values else {"median": None, "min": None, "max": None, "n": 0}


def spread_table(title: str, cols: dict[str, str], out: dict) -> None:
    """Print one row of `out`'s spreads (`cols`: key -> column header) as "median (min-max)" under `title`."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in cols.values():
        t.add_column(c)
    t.add_row(*(f"{out[k]['median']:.2f} ({out[k]['min']:.2f}-{out[k]['max']:.2f})" for k in cols))
    Console(width=170).print(t)


def tiny_default_data(work: Path) -> dict:
    """The tiny default (configs/tiny-cpu.yaml) prepared, extracted and its vocab built in a store under
    `work` (content-addressed: a second call reuses it): {"cfg", "prep", "version", "ext", "voc"}."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_extract, stage_preflight, stage_prepare, stage_vocab

    root = Path(__file__).resolve().parents[1]
    tiny = root / ".cache" / "tiny-target"
    cfg = load_config(root / "configs" / "tiny-cpu.yaml", [f"store={work / 'store'}", f"target.model={tiny}"])
    quiet = lambda _: None  # noqa: E731
    prep = stage_prepare(cfg, log=quiet)
    version = plan_extract(cfg, prep, stage_preflight(cfg, prep, log=quiet))
    ext = stage_extract(cfg, version, log=quiet)
    voc = stage_vocab(cfg, prep, version, log=quiet)
    return {"cfg": cfg, "prep": prep, "version": version, "ext": ext, "voc": voc}
