"""Issue 14's "a gate tested on one architecture is untested": clean extractions of random small
targets of other architectures — a 6-layer Qwen3 (qk-norm, GQA; default layer ids that would have
collided before: [1, 3, 5] + 6) and a 5-layer DeepSeek-V3 (MLA + routed/shared experts, noaux_tc) —
pass verify with default settings (every-row checks, streamed reference in the model's dtype,
in-engine batch invariance), and a structurally perfect corruption of one record is still named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from eagle3_pipeline.core.config import VerifyConfig, load_config
from tests.helpers.targets import random_deepseek_v3, random_qwen3

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = {"qwen3-6-layers": (random_qwen3, [1, 3, 5, 6]), "deepseek-v3-mla-moe": (random_deepseek_v3, [1, 2, 4, 5])}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def clean_run(request, tiny_target, tmp_path_factory):
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_extract, stage_preflight, stage_prepare

    build, ids = BUILDERS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = build(tiny_target, root / "model")
    corpus = tiny_target / "corpus"
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        f"store={root / 'store'}", f"target.model={model}", "prepare.heldout_rows=4", "extract.rows_per_shard=24",
        f"prepare.sources=[{{path: {corpus / 'sharegpt.jsonl'}, limit: 30}}, {{path: {corpus / 'openai.jsonl'}, limit: 30}}]"])
    quiet = lambda _: None  # noqa: E731
    prep = stage_prepare(cfg, log=quiet)
    pre = stage_preflight(cfg, prep, log=quiet)
    assert pre.layer_ids == ids
    version = plan_extract(cfg, prep, pre)
    stage_extract(cfg, version, log=quiet)
    return request.param, cfg, version


def test_clean_extraction_passes_verify_with_defaults(clean_run, tmp_path):
    from eagle3_pipeline.verify.stage import verify

    name, cfg, version = clean_run
    assert cfg.verify == VerifyConfig(**cfg.verify.model_dump())  # the config's own (default) settings
    res = verify(cfg.verify, cfg.target, version, log=print)
    assert res.passed, (name, res.problems[:5])
    c = res.checks
    assert c.fingerprint.records == version.rows and c.fingerprint.min_agreement >= 0.95, c.fingerprint
    assert c.identity.records == version.rows and c.reference.samples and c.reference.peak_rss_bytes
    assert c.invariance.samples and c.invariance.skipped is None
    print(f"{name}: reference max rel err {c.reference.max_rel_err}, worst reference min cosine "
          f"{c.reference.min_cosine}, invariance max rel err {c.invariance.max_rel_err}, worst mean cosine "
          f"{c.invariance.min_cosine}, fingerprint min agreement {c.fingerprint.min_agreement}")


def test_one_permuted_record_is_named(clean_run, tmp_path):
    from eagle3_pipeline.verify.stage import verify

    name, cfg, version = clean_run
    copy = version.model_copy(update={"dir": str(tmp_path / "x"), "pool_dir": None})
    for sub in ("hidden_states", "fingerprints"):
        shutil.copytree(version.path / sub, copy.path / sub)
    shutil.copy(version.manifest_path, copy.manifest_path)
    victim = copy.record_path(7)
    rec = load_file(str(victim))
    rec["hidden_states"] = rec["hidden_states"][:, [1, 0, 2, 3]].contiguous()
    save_file(rec, str(victim))
    res = verify(cfg.verify.model_copy(update={"reference_samples": 0, "move_bad_files": False}), cfg.target, copy,
                 log=lambda m: None)
    assert not res.passed and res.bad_rows == [7], (name, res.problems)
