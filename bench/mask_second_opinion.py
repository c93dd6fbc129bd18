"""What prepare's second opinion on every loss mask (data/mask_check.py `second_opinion`) costs, side by side in one
process, alternating every round: mask_check.encode_checked with it, and with it replaced by a no-op, on the same
conversations of the tiny Llama (fast tokenizer) and the tiny Kimi-like MoE (Python tokenizer, thinking, tools).

Usage: .venv/bin/python bench/mask_second_opinion.py [--rows 400] [--rounds 7]
Prints per target the seconds per round of each arm and the ratio with ÷ without: median (min-max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from eagle3_pipeline.core.config import TargetConfig
    from eagle3_pipeline.data import mask_check
    from eagle3_pipeline.data.formats import normalise
    from eagle3_pipeline.data.tokenized import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    own = mask_check.second_opinion
    print(f"{'target':<12} {'with s/round':>13} {'without':>9}  with ÷ without: median (min-max)")
    for name, model in (("tiny Llama", ROOT / ".cache" / "tiny-target"), ("tiny MoE", ROOT / ".cache" / "tiny-moe")):
        tok = load_tokenizer(TargetConfig(model=str(model), trust_remote_code=name == "tiny MoE"))
        lines = (model / "corpus" / "openai.jsonl").read_text().splitlines()[: args.rows]
        items = [normalise(json.loads(x), "openai", "bench", i, True) for i, x in enumerate(lines)]

        def run() -> float:
            t0 = time.perf_counter()
            for it in items:
                mask_check.encode_checked(tok, it.messages, "conversation", it.tools)
            return time.perf_counter() - t0

        with_s, without_s = [], []
        for _ in range(args.rounds):
            mask_check.second_opinion = own
            with_s.append(run())
            mask_check.second_opinion = lambda *a, **k: ("agree", None)
            without_s.append(run())
        mask_check.second_opinion = own
        ratios = [a / b for a, b in zip(with_s, without_s)]
        print(f"{name:<12} {statistics.median(with_s):>13.3f} {statistics.median(without_s):>9.3f}  "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
