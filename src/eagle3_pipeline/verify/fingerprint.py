"""The verify gate's final-layer fingerprint check: `final_layer_check` builds the shared check
(eagle3_pipeline/checks/final_layer.py, also used per row by online training) for a target, or says why it
cannot run; its verdict on each record is verify/learned.py `FingerprintAgreement`."""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.checks.final_layer import FP8_SLACK, FinalLayerCheck
from eagle3_pipeline.records.contracts import fingerprint_blocker


def final_layer_check(target, dims, cfg, storage_dtype: str) -> tuple[FinalLayerCheck | None, str | None]:
    """The check for `target` (config.TargetConfig) or (None, why not) for targets it cannot read."""
    why = fingerprint_blocker(target, dims)
    if why:
        return None, why
    model_dir = Path(target.model)
    try:
        return FinalLayerCheck(model_dir, dims.norm_eps, cfg.fingerprint_atol, cfg.fingerprint_rtol,
                               FP8_SLACK if storage_dtype == "fp8" else 1.0, cfg.fingerprint_stol), None
    except (OSError, ValueError, KeyError) as e:
        return None, f"final norm / lm_head of {model_dir} not readable: {type(e).__name__}: {e}"
