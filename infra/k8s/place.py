"""This cluster's settings (infra/k8s/cluster.env, copied from cluster.env.example) put into what is applied.

  place.py template <infra/k8s-{gpu,cpu}-job-template.json> <gpu|cpu>
      a pool's job template with this cluster's placement as its defaults, printed as JSON (pools.sh)
  place.py manifest <infra/k8s/NAME.yaml>
      a manifest with every ${VAR} filled in, printed for `kubectl apply -f -` (render.sh)

Read from the environment (render.sh and pools.sh source cluster.env first); JSON where a structure:
  EAGLE3_<KIND>_NODE_SELECTOR   an object of node labels; KIND gpu: the GPU pool's Jobs, cpu: the CPU pool's Jobs
                                and every pod of the manifests (the server, PostgreSQL, the worker, the data pod,
                                the model-staging Job)
  EAGLE3_<KIND>_TOLERATIONS     an array of tolerations (the taints of the nodes those pods go to)
  EAGLE3_GPUS_PER_NODE          GPUs on one node of the GPU pool (preflight refuses a stage asking for more)
  EAGLE3_CLUSTER_API_URL        the Prefect API as pods in the cluster reach it (default: the in-cluster Service)
  EAGLE3_UI_API_URL             the API as the browser reaches it (default: the port-forward of docs step 6)
Both templates' pods also get EAGLE3_GPU_NODE_SELECTOR and EAGLE3_GPUS_PER_NODE in their environment: the
pipeline's preflight (a CPU pod) checks the config against the GPU pool's nodes (core/cluster.gpu_pool_problems).
A value that is not valid JSON of the right type, a missing variable or an API URL on localhost stops here,
naming the variable."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPU_TEMPLATE = HERE.parent / "k8s-gpu-job-template.json"
# prefect-server.yaml's Service `prefect-server` in namespace eagle3
CLUSTER_API_URL = "http://prefect-server.eagle3.svc.cluster.local:4200/api"
UI_API_URL = "http://localhost:4200/api"  # the browser's, through `kubectl port-forward svc/prefect-server 4200`
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")


def fail(msg: str):
    sys.exit(f"place.py: {msg}")


def json_setting(var: str, typ: type, default):
    """The JSON value of `var`, checked: an object of strings (a node selector) or an array (tolerations)."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        value = json.loads(raw)
    except ValueError as e:
        fail(f"{var}={raw!r} is not JSON: {e}")
    if not isinstance(value, typ) or (typ is dict and not all(isinstance(v, str) for v in value.values())):
        fail(f"{var}={raw!r}: expected a JSON {'object of strings' if typ is dict else 'array'}")
    return value


def placement(kind: str, default_selector=None, default_tolerations=None) -> tuple[dict, list]:
    k = kind.upper()
    return (json_setting(f"EAGLE3_{k}_NODE_SELECTOR", dict, default_selector or {}),
            json_setting(f"EAGLE3_{k}_TOLERATIONS", list, default_tolerations or []))


def cluster_api_url() -> str:
    url = os.environ.get("EAGLE3_CLUSTER_API_URL", "").strip() or CLUSTER_API_URL
    host = re.sub(r"^[a-z]+://", "", url).split("/")[0].rsplit(":", 1)[0]
    if not url.startswith(("http://", "https://")) or host in LOCAL_HOSTS:
        fail(f"EAGLE3_CLUSTER_API_URL={url!r}: pods reach the server by its Service (default {CLUSTER_API_URL}) "
             f"or an address the cluster can route to, never localhost (that is the pod itself)")
    return url


def gpus_per_node() -> int | None:
    raw = os.environ.get("EAGLE3_GPUS_PER_NODE", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        fail(f"EAGLE3_GPUS_PER_NODE={raw!r}: expected a whole number of GPUs >= 1")
    return int(raw)


def template(path: str, kind: str) -> dict:
    t = json.load(open(path))
    props = t["variables"]["properties"]
    selector, tolerations = placement(kind, props["node_selector"].get("default"), props["tolerations"].get("default"))
    props["node_selector"]["default"], props["tolerations"]["default"] = selector, tolerations
    gpu_selector = selector if kind == "gpu" else placement(
        "gpu", json.load(open(GPU_TEMPLATE))["variables"]["properties"]["node_selector"]["default"])[0]
    env = props["env"]["default"]
    env["PREFECT_API_URL"] = cluster_api_url()
    env["EAGLE3_GPU_NODE_SELECTOR"] = json.dumps(gpu_selector, sort_keys=True)
    if (n := gpus_per_node()) is not None:
        env["EAGLE3_GPUS_PER_NODE"] = str(n)
    return t


def manifest(path: str) -> str:
    """The manifest's text with each ${VAR} replaced, as envsubst would, but refusing an unset variable."""
    selector, tolerations = placement("cpu")
    special = {"EAGLE3_CPU_NODE_SELECTOR": json.dumps(selector), "EAGLE3_CPU_TOLERATIONS": json.dumps(tolerations),
               "EAGLE3_CLUSTER_API_URL": cluster_api_url(),
               "EAGLE3_UI_API_URL": os.environ.get("EAGLE3_UI_API_URL", "").strip() or UI_API_URL}
    text = Path(path).read_text()
    missing = sorted({v for v in re.findall(r"\$\{([A-Z0-9_]+)\}", text)
                      if v not in special and not os.environ.get(v)})
    if missing:
        fail(f"{path} needs {', '.join(missing)}: set them in infra/k8s/cluster.env or export them "
             f"(docs/kubernetes.md names each step's)")
    return re.sub(r"\$\{([A-Z0-9_]+)\}", lambda m: special.get(m.group(1)) or os.environ[m.group(1)], text)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "template" and sys.argv[3] in ("gpu", "cpu"):
        print(json.dumps(template(sys.argv[2], sys.argv[3]), indent=2))
    elif len(sys.argv) == 3 and sys.argv[1] == "manifest":
        sys.stdout.write(manifest(sys.argv[2]))
    else:
        fail("usage: place.py template <job-template.json> gpu|cpu | place.py manifest <manifest.yaml>")
