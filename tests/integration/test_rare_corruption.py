"""Issue 11's done-when, end to end: a connector that writes ~1 request in N wrong in structurally
perfect ways (tests/helpers/broken_connector.RareCorruptionConnector: permuted aux layers, a zeroed
tail after the first KV block, another request's states, a few tokens' states, a few tokens' aux layers
only), plugged in through
`extract.connector_module` / `extract.connector_name`, makes `eagle3 run` stop at verify with exit
code 4 before training, naming exactly the bad records. Run on the tiny Llama and, when it is built,
the tiny Kimi-like MoE target (MLA + MoE, Python tokenizer, agentic data)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.broken_connector import AUX_ONLY_MODES, CORRUPT_EVERY_ENV, FEW_TOKEN_MODES, corruption_of

ROOT = Path(__file__).resolve().parents[2]
EVERY = 6  # ~17% of requests: a dozen bad records in a run of ~80 rows, of six kinds


def _why(out: str) -> str:
    """The run's error lines (the CLI's one-line error, exceptions, failed stages) before its tail: a
    tail alone is mostly the temporary Prefect server shutting down."""
    from eagle3_pipeline.core.proc import EXCEPTION_LINE

    lines = [x for x in out.splitlines() if "eagle3 run: error" in x or EXCEPTION_LINE.search(x)]
    return "error lines:\n" + "\n".join(lines[:40]) + "\n--- tail:\n" + out[-2500:]


def _targets():
    out = [("tiny-cpu", ROOT / ".cache" / "tiny-target")]
    moe = Path(os.environ.get("EAGLE3_TINY_MOE", ROOT / ".cache" / "tiny-moe"))
    out.append(("tiny-moe", moe))
    return out


@pytest.mark.parametrize("config, model", _targets(), ids=[t[0] for t in _targets()])
def test_rare_corruption_stops_the_run_at_verify(config, model, tiny_target, tmp_path):
    if config == "tiny-moe" and not (model / "tiny_target.json").exists():
        pytest.skip(f"tiny-moe target not built at {model} (make tiny builds it)")
    cfg_path = ROOT / "configs" / f"{config}.yaml"
    from eagle3_pipeline.core.config import load_config

    base = load_config(cfg_path)
    per_source = 80 // len(base.prepare.sources)  # ~80 conversations, whatever the config's sources
    sources = ", ".join(f"{{path: {s.path}, limit: {per_source}}}" for s in base.prepare.sources)
    sets = [f"store={tmp_path / 'store'}", f"target.model={model}", f"prepare.sources=[{sources}]",
            "prepare.heldout_rows=4", "extract.rows_per_shard=32", "verify.reference_samples=0", "verify.allow_skip=[reference]",
            "extract.connector_module=tests.helpers.broken_connector",
            "extract.connector_name=RareCorruptionConnector"]
    env = {**os.environ, CORRUPT_EVERY_ENV: str(EVERY),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PREFECT_API_URL", None)  # `eagle3 run` starts its own temporary server, as a user's would
    cmd = [str(Path(sys.executable).parent / "eagle3"), "run", "--config", str(cfg_path),
           "--output-dir", str(tmp_path / "runs"), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, _why(out)  # exit code 4: a gate failed
    assert "VerifyFailed" in out, out[-4000:]

    rep = json.loads((tmp_path / "runs" / "latest" / "report.json").read_text())
    assert rep["status"] == "failed" and "train" not in rep["stages"] and "verify" not in rep["stages"]
    import datasets

    tok = datasets.load_from_disk(rep["artifacts"]["tokenized"] or
                                  str(next((tmp_path / "store").rglob("tokenized"))))
    expected = {i for i, ids in enumerate(tok["input_ids"]) if corruption_of(ids, EVERY)}
    assert expected, "the corpus cut gave no corrupted request: pick another EVERY"
    named = {int(line.split("hs_")[1].split(".safetensors")[0]) for line in out.splitlines()
             if ".safetensors (row " in line and "hs_" in line}
    verify_json = json.loads(next((tmp_path / "store").rglob("verify.json")).read_text())
    assert set(verify_json["bad_rows"]) == expected, (sorted(verify_json["bad_rows"]), sorted(expected))
    assert named <= expected and named, (sorted(named), sorted(expected))  # the error names bad records only
    modes = {corruption_of(tok["input_ids"][i], EVERY) for i in expected}
    print(f"{config}: {len(expected)} corrupted rows of {len(tok)}, kinds {sorted(modes)}")
    assert len(modes) >= 2, modes  # more than one kind of corruption was exercised (deterministic data)
    few = [i for i in expected if corruption_of(tok["input_ids"][i], EVERY) in FEW_TOKEN_MODES]
    aux = [i for i in expected if corruption_of(tok["input_ids"][i], EVERY) in AUX_ONLY_MODES]
    assert few and aux, f"no few-token or no aux-only corruption among {sorted(modes)}: pick another EVERY"
    lines_of = {i: [x for x in verify_json["problems"] if f"hs_{i}.safetensors (row {i}" in x] for i in few + aux}
    for i in few + aux:  # a few tokens' states replaced: the engine's state sketch names their layers and positions
        assert any("stored states differ from the ones the target computed" in x and " positions [" in x
                   for x in lines_of[i]), lines_of[i]
    fingerprint = "does not reproduce the target's logits at "
    # every layer of a few tokens replaced: the final layer too, and the fingerprint names positions where
    # another request's final state changes the target's top-2 logit margin (not every such token does)
    assert any(fingerprint in x and "(positions [" in x for i in few for x in lines_of[i]), lines_of
    assert not any(fingerprint in x for i in aux for x in lines_of[i]), lines_of  # the final layer is right there


FORWARD_EVERY = 20  # one request in 20: the rate the reference sample is sized for


def test_a_forward_that_computes_rows_wrong_stops_at_verify(tiny_target, tmp_path):
    """Upstream of every engine-side record: the target's forward runs one request in 20 on other input ids
    (tests/helpers/forward_corruption.py). The captured states, the state sketch, the logits and the fingerprint
    all come from that forward, so they agree; structure, fingerprint and sketch pass every row. The target's own
    predictions no longer match those rows' next tokens (verify/prediction.py), each flagged row is recomputed with
    the target and confirmed: `eagle3 run` stops at verify (exit 4), naming exactly the corrupted rows, and the
    report says what the reference sample could have caught."""
    from tests.helpers.forward_corruption import EVERY_ENV, MODE_ENV, corrupted

    cfg_path = ROOT / "configs" / "tiny-cpu.yaml"
    from eagle3_pipeline.core.config import load_config

    base = load_config(cfg_path)
    per_source = 160 // len(base.prepare.sources)
    sources = ", ".join(f"{{path: {s.path}, limit: {per_source}}}" for s in base.prepare.sources)
    sets = [f"store={tmp_path / 'store'}", f"target.model={tiny_target}", f"prepare.sources=[{sources}]",
            "prepare.heldout_rows=4", "extract.rows_per_shard=48",
            "extract.connector_module=tests.helpers.forward_corruption",
            "extract.connector_name=ForwardCorruptionConnector"]
    env = {**os.environ, EVERY_ENV: str(FORWARD_EVERY), MODE_ENV: "tokens",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PREFECT_API_URL", None)
    cmd = [str(Path(sys.executable).parent / "eagle3"), "run", "--config", str(cfg_path),
           "--output-dir", str(tmp_path / "runs"), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, _why(out)
    import datasets

    rep = json.loads((tmp_path / "runs" / "latest" / "report.json").read_text())
    assert rep["status"] == "failed" and "train" not in rep["stages"]
    tok = datasets.load_from_disk(rep["artifacts"]["tokenized"] or str(next((tmp_path / "store").rglob("tokenized"))))
    expected = {i for i, ids in enumerate(tok["input_ids"]) if corrupted(ids, FORWARD_EVERY)}
    assert expected, "no corrupted request in the slice"
    v = json.loads(next((tmp_path / "store").rglob("verify.json")).read_text())
    assert set(v["bad_rows"]) == expected, (sorted(v["bad_rows"]), sorted(expected))
    assert v["fingerprint"]["rows_failed"] == 0 and v["sketch_failed"] == 0  # transport is exact: they agree
    assert v["prediction"]["flagged"] == len(expected) and v["cleared"] == {}
    for i in expected:
        assert any(p.startswith(f"hs_{i}.safetensors (row {i}") and "the target's own predictions" in p
                   for p in v["problems"]), i
        assert any(p.startswith(f"hs_{i} ") and "differs from the reference" in p for p in v["problems"]), i
    power = v["reference_power"]
    assert power["power"] >= 0.95 and power["rate"] == 0.05 and "caught with probability" in power["says"]
