"""What preflight's import memo saves a process that runs preflight (preflight/import_memo.py): a fresh interpreter
runs `preflight` on the tiny default, with EAGLE3_PREFLIGHT_MEMO=off (it imports vLLM, speculators and the model
class to prove their APIs, as every such process did before) and with a memo of the same installed files (it imports
neither). Alternating in one run, each way once per round; per way the process's wall and CPU seconds (its rusage),
and whether vLLM was imported.

Usage: .venv/bin/python bench/preflight_memo.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench_results import record, spread, spread_table  # bench/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.preflight.stage import preflight
    cfg = load_config(sys.argv[1], [f"store={sys.argv[2]}"])
    preflight(cfg, 10_000, Path(sys.argv[2]), log=lambda m: None)
    print(json.dumps({"vllm_imported": "vllm" in sys.modules}))
""")


def one(memo: str, store: Path) -> tuple[float, float, bool]:
    """(wall, CPU, vLLM imported) of one process running preflight with EAGLE3_PREFLIGHT_MEMO=`memo`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "configs" / "tiny-cpu.yaml"), str(store)], cwd=ROOT,
                         check=True, capture_output=True, text=True, env={**os.environ, "EAGLE3_PREFLIGHT_MEMO": memo})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out.stdout.strip().splitlines()[-1])["vllm_imported"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="e3bench-memo-") as tmp:
        memo, store = str(Path(tmp) / "memo"), Path(tmp) / "store"
        one(memo, store)  # warm-up: the page cache, and the memo of these installed files
        got: dict[str, list] = {"off": [], "memo": []}
        for i in range(args.rounds):
            for way in (("memo", "off") if i % 2 else ("off", "memo")):
                got[way].append(one("off" if way == "off" else memo, store))
    out = {"rounds": args.rounds, **{f"{w}_{k}": spread([r[j] for r in got[w]])
                                     for w in got for j, k in ((0, "wall_s"), (1, "cpu_s"))},
           "vllm_imported": {w: sorted({r[2] for r in got[w]}) for w in got},
           "cpu_ratio": spread([m[1] / o[1] for m, o in zip(got["memo"], got["off"])]),
           "cpu_saved_s": spread([o[1] - m[1] for m, o in zip(got["memo"], got["off"])])}
    spread_table(f"a process running preflight on the tiny default, {args.rounds} alternating rounds: median (min-max)",
                 {"off_wall_s": "off: wall (s)", "memo_wall_s": "memo: wall (s)", "off_cpu_s": "off: CPU (s)",
                  "memo_cpu_s": "memo: CPU (s)", "cpu_ratio": "memo ÷ off (CPU)", "cpu_saved_s": "CPU saved (s)"}, out)
    print(f"vLLM imported: off {out['vllm_imported']['off']}, memo {out['vllm_imported']['memo']}")
    record("preflight_memo", out)


if __name__ == "__main__":
    main()
