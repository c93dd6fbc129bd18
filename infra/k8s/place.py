"""A job template (infra/k8s-{gpu,cpu}-job-template.json) with this cluster's node placement as its defaults,
printed as JSON (pools.sh). From the environment (infra/k8s/cluster.env.example), each JSON:
  EAGLE3_<KIND>_NODE_SELECTOR   an object of node labels (GPU operator, GKE, EKS: cluster.env.example)
  EAGLE3_<KIND>_TOLERATIONS     an array of tolerations (the taints of the nodes the pods go to)
  EAGLE3_IMAGE_PULL_SECRET      a name: image_pull_secrets = [{"name": ...}]
A value that is not valid JSON of the right type stops here, naming the variable."""

import json
import os
import sys


def main(path: str, kind: str) -> dict:
    t = json.load(open(path))
    props = t["variables"]["properties"]
    for var, key, typ in ((f"EAGLE3_{kind.upper()}_NODE_SELECTOR", "node_selector", dict),
                          (f"EAGLE3_{kind.upper()}_TOLERATIONS", "tolerations", list)):
        raw = os.environ.get(var)
        if not raw:
            continue
        try:
            value = json.loads(raw)
        except ValueError as e:
            sys.exit(f"{var}={raw!r} is not JSON: {e}")
        if not isinstance(value, typ) or (typ is dict and not all(isinstance(v, str) for v in value.values())):
            sys.exit(f"{var}={raw!r}: expected a JSON {'object of strings' if typ is dict else 'array'}")
        props.setdefault(key, {"type": "object" if typ is dict else "array"})["default"] = value
    secret = os.environ.get("EAGLE3_IMAGE_PULL_SECRET")
    if secret:
        props["image_pull_secrets"]["default"] = [{"name": secret}]
    return t


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2]), indent=2))
