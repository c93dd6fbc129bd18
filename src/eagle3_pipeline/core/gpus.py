"""GPU products: one GPU's memory by product, and the node labels that name a product on a Kubernetes node.

Owns the one table of GPU memory the project uses (`GPU_MEMORY_GIB`: engine/start.what_fits names GPUs that would
hold a model, core/cluster.gpu_pool_problems checks a config's `<stage>.gpu_memory_gib` against the GPU pool's
nodes) and `NODE_LABELS`: the label values the NVIDIA GPU operator (GPU feature discovery), GKE and EKS put on a GPU
node, mapped to the product and, where the label fixes it (an instance type), the GPUs on one node. Reads and
writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

# One GPU's memory in GiB, as configs write `<stage>.gpu_memory_gib` (NVIDIA's "80GB"/"141GB": what nvidia-smi
# lists is within 1% of it)
GPU_MEMORY_GIB: dict[str, float] = {
    "A100-40GB": 40, "A100-80GB": 80, "H100": 80, "H100-NVL": 94, "H20": 96, "H200": 141, "B200": 180,
    "GB200": 186, "MI300X": 192,
}
# a configured memory this far from the product's (relative) still describes that product
MEMORY_TOLERANCE = 0.03

PRODUCT_LABEL = "nvidia.com/gpu.product"        # GPU feature discovery (NVIDIA GPU operator)
GKE_LABEL = "cloud.google.com/gke-accelerator"
INSTANCE_LABEL = "node.kubernetes.io/instance-type"
GFD_MEMORY_LABEL = "nvidia.com/gpu.memory"      # GPU feature discovery: one GPU's memory in MiB
GFD_COUNT_LABEL = "nvidia.com/gpu.count"

# label -> value -> (product, GPUs per node where the label fixes it)
NODE_LABELS: dict[str, dict[str, tuple[str, int | None]]] = {
    PRODUCT_LABEL: {
        "NVIDIA-A100-SXM4-40GB": ("A100-40GB", None), "NVIDIA-A100-PCIE-40GB": ("A100-40GB", None),
        "NVIDIA-A100-SXM4-80GB": ("A100-80GB", None), "NVIDIA-A100-80GB-PCIe": ("A100-80GB", None),
        "NVIDIA-H100-80GB-HBM3": ("H100", None), "NVIDIA-H100-PCIe": ("H100", None),
        "NVIDIA-H100-NVL": ("H100-NVL", None), "NVIDIA-H20": ("H20", None),
        "NVIDIA-H200": ("H200", None), "NVIDIA-H200-NVL": ("H200", None),
        "NVIDIA-B200": ("B200", None), "NVIDIA-GB200": ("GB200", None),
    },
    GKE_LABEL: {
        "nvidia-tesla-a100": ("A100-40GB", None), "nvidia-a100-80gb": ("A100-80GB", None),
        "nvidia-h100-80gb": ("H100", None), "nvidia-h100-mega-80gb": ("H100", None),
        "nvidia-h200-141gb": ("H200", None), "nvidia-b200": ("B200", None),
    },
    INSTANCE_LABEL: {
        "p4d.24xlarge": ("A100-40GB", 8), "p4de.24xlarge": ("A100-80GB", 8), "p5.48xlarge": ("H100", 8),
        "p5e.48xlarge": ("H200", 8), "p5en.48xlarge": ("H200", 8), "p6-b200.48xlarge": ("B200", 8),
        "a3-highgpu-8g": ("H100", 8), "a3-megagpu-8g": ("H100", 8), "a3-ultragpu-8g": ("H200", 8),
        "a4-highgpu-8g": ("B200", 8),
    },
}


@dataclass(frozen=True)
class NodeGpus:
    """What a node selector says about the GPUs of the nodes it selects."""
    named_by: str                # "nvidia.com/gpu.product=NVIDIA-H200": the label that told (for messages)
    product: str | None          # a key of GPU_MEMORY_GIB, None when the label's value is not in NODE_LABELS
    memory_gib: float | None
    gpus_per_node: int | None


def node_gpus(selector: Mapping[str, str]) -> NodeGpus | None:
    """The GPUs a node selector picks: from a label whose value names a known product (GPU feature discovery's
    product, GKE's accelerator, an instance type), else GPU feature discovery's memory label, else the first
    such label with a value not in the table (product None); None when the selector has none of these labels."""
    count = selector.get(GFD_COUNT_LABEL, "")
    count = int(count) if count.isdigit() else None
    unknown = None
    for label, products in NODE_LABELS.items():
        if label in selector:
            value = selector[label]
            if value in products:
                product, per_node = products[value]
                return NodeGpus(f"{label}={value}", product, GPU_MEMORY_GIB[product], per_node or count)
            unknown = unknown or NodeGpus(f"{label}={value}", None, None, count)
    mib = selector.get(GFD_MEMORY_LABEL, "")
    if mib.isdigit():
        return NodeGpus(f"{GFD_MEMORY_LABEL}={mib}", None, int(mib) / 1024, count)
    return unknown


def same_memory(configured_gib: float, product_gib: float) -> bool:
    return abs(configured_gib - product_gib) <= MEMORY_TOLERANCE * product_gib
