"""The config against the GPU pool's nodes (cluster.gpu_pool_problems, run by preflight): a stage's gpu_memory_gib
that is not the memory of the GPU product the pool's node selector names fails, naming both; a stage asking one pod
for more GPUs than a node has fails; a product core/gpus.py does not know is a warning. The shipped production
configs pass on the shipped pools (the GPU job template's default, and each block of cluster.env.example)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.core.cluster import gpu_pool_problems
from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.core.gpus import GPU_MEMORY_GIB, NODE_LABELS, node_gpus

REPO = Path(__file__).parents[2]
PRODUCTION = ("kimi-k2.5-tp8", "deepseek-v3-tp8", "qwen3-8b", "llama-3.1-8b")
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def pool(selector: dict, gpus_per_node: int | None = 8) -> dict[str, str]:
    """The environment infra/k8s/place.py gives the pools' pods."""
    env = {"EAGLE3_GPU_NODE_SELECTOR": json.dumps(selector)}
    if gpus_per_node is not None:
        env["EAGLE3_GPUS_PER_NODE"] = str(gpus_per_node)
    return env


def shipped_selectors() -> dict[str, dict]:
    """The GPU job template's default node selector and each GPU block of cluster.env.example."""
    tpl = json.loads((REPO / "infra" / "k8s-gpu-job-template.json").read_text())
    out = {"template": tpl["variables"]["properties"]["node_selector"]["default"]}
    for line in (REPO / "infra" / "k8s" / "cluster.env.example").read_text().splitlines():
        key, _, value = line.removeprefix("# ").partition("=")
        if key == "EAGLE3_GPU_NODE_SELECTOR":
            sel = json.loads(value.strip("'"))
            out[next(iter(sel.values()))] = sel
    assert len(out) == 4, out  # the template + GPU operator, GKE, EKS
    return out


def kimi(*overrides: str):
    return load_config(REPO / "configs" / "kimi-k2.5-tp8.yaml", list(overrides))


@pytest.mark.parametrize("name", PRODUCTION)
@pytest.mark.parametrize("where", list(shipped_selectors()))
def test_production_configs_pass_on_the_shipped_pools(name, where):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    problems, warnings = gpu_pool_problems(cfg, pool(shipped_selectors()[where]))
    assert problems == []
    if cfg.extract.gpu_memory_gib is not None:  # the H200 configs: nothing left unchecked
        assert warnings == []


def test_a_gpu_memory_the_pool_does_not_have_fails_naming_both():
    """Kimi's config says H200 (141 GiB); the pool selects H100 nodes (80 GiB)."""
    problems, _ = gpu_pool_problems(kimi(), pool(H100))
    assert len(problems) == 2, problems  # extract and evaluate
    for stage, msg in zip(("extract", "evaluate"), problems):
        assert msg.startswith(f"{stage}.gpu_memory_gib 141 disagrees with the GPU pool's nodes "
                              f"(nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3): H100 GPUs of 80 GiB"), msg
    # the same through GKE's and EKS's labels, and GPU feature discovery's memory label (MiB)
    for selector, gib in (({"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}, "80"),
                          ({"node.kubernetes.io/instance-type": "p5.48xlarge"}, "80"),
                          ({"nvidia.com/gpu.memory": "81559"}, "79.6")):
        problems, _ = gpu_pool_problems(kimi(), pool(selector))
        assert len(problems) == 2 and problems[0].startswith("extract.gpu_memory_gib 141 disagrees"), problems
        assert f"GPUs of {gib} GiB" in problems[0], (selector, problems)
    # what nvidia-smi lists for an H200 (140.4 GiB) is the same product as the config's 141
    assert gpu_pool_problems(kimi("extract.gpu_memory_gib=140", "evaluate.gpu_memory_gib=140.4"),
                             pool({"nvidia.com/gpu.product": "NVIDIA-H200"})) == ([], [])


def test_an_unknown_product_is_a_warning_not_a_pass():
    problems, warnings = gpu_pool_problems(kimi(), pool({"nvidia.com/gpu.product": "NVIDIA-X9000"}))
    assert problems == [] and any("nvidia.com/gpu.product=NVIDIA-X9000 is not a GPU product" in w for w in warnings)
    problems, warnings = gpu_pool_problems(kimi(), pool({"pool": "gpu"}, None))
    assert problems == [] and any("names no GPU product" in w for w in warnings), warnings
    assert any("GPUs per node of the GPU pool unknown" in w for w in warnings), warnings
    unset = load_config(REPO / "configs" / "qwen3-8b.yaml")
    _, warnings = gpu_pool_problems(unset, pool({"nvidia.com/gpu.product": "NVIDIA-H200"}))
    assert any(w.startswith("extract.gpu_memory_gib is not set: the GPU pool's nodes") and "141 GiB" in w
               for w in warnings), warnings


@pytest.mark.parametrize("override, what", [
    ("train.world_size=16", "train.world_size 16 asks one pod for 16 GPUs"),
    ("extract.tensor_parallel_size=16", "extract.tensor_parallel_size 16 asks one pod for 16 GPUs"),
    ("evaluate.tensor_parallel_size=16", "evaluate.tensor_parallel_size 16 asks one pod for 16 GPUs"),
])
def test_more_gpus_than_a_node_has_fails(override, what):
    problems, _ = gpu_pool_problems(kimi(override), pool({"nvidia.com/gpu.product": "NVIDIA-H200"}, 8))
    assert any(p.startswith(what) and "have 8 GPUs each" in p for p in problems), problems


def test_gpus_per_node_from_an_instance_type_and_from_the_setting_must_agree():
    eks = {"node.kubernetes.io/instance-type": "p5en.48xlarge"}  # 8 x H200
    assert gpu_pool_problems(kimi(), pool(eks, None)) == ([], [])  # the instance type says 8
    problems, _ = gpu_pool_problems(kimi(), pool(eks, 4))
    assert any("EAGLE3_GPUS_PER_NODE 4" in p and "have 8 GPUs each" in p for p in problems), problems
    problems, _ = gpu_pool_problems(kimi(), pool({"nvidia.com/gpu.product": "NVIDIA-H200"}, 4))
    assert sum("asks one pod for 8 GPUs" in p for p in problems) == 3, problems  # extract, evaluate, train


def test_off_the_pools_nothing_is_checked_and_a_broken_setting_is_named():
    assert gpu_pool_problems(kimi(), {}) == ([], [])
    problems, _ = gpu_pool_problems(kimi(), {"EAGLE3_GPU_NODE_SELECTOR": "nvidia.com/gpu.product=NVIDIA-H200"})
    assert problems and problems[0].startswith("EAGLE3_GPU_NODE_SELECTOR='nvidia.com/gpu.product=NVIDIA-H200'")


def test_one_table_of_gpu_memory():
    """Every product a node label names has a memory, and engine/start's list of what fits reads the same table."""
    from eagle3_pipeline.engine.start import GPU_TYPES

    assert all(GPU_TYPES[k] == GPU_MEMORY_GIB[k] for k in GPU_TYPES)
    for label, values in NODE_LABELS.items():
        for value, (product, _) in values.items():
            assert product in GPU_MEMORY_GIB, (label, value)
            assert node_gpus({label: value}).memory_gib == GPU_MEMORY_GIB[product]
    assert node_gpus({"kubernetes.io/os": "linux"}) is None


def test_preflight_refuses_the_wrong_gpus_with_everything_else(tmp_path, monkeypatch):
    """In a pool's pod (the environment place.py gives it), preflight lists the pool's problem beside the others."""
    from eagle3_pipeline.preflight.stage import PreflightFailed, preflight

    models = Path(__file__).parents[1] / "data" / "model_configs"
    cfg = kimi(f"target.model={models / 'kimi-k2.5'}", f"store={tmp_path}")
    for k, v in pool(H100).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(PreflightFailed) as e:
        preflight(cfg, tokens_estimate=1000, out_dir=tmp_path, log=lambda m: None)
    msg = str(e.value)
    assert "extract.gpu_memory_gib 141 disagrees with the GPU pool's nodes" in msg and "80 GiB" in msg, msg
    assert "no weight files" in msg, msg  # every problem at once
