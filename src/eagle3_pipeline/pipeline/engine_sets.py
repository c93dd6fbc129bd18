"""An engine set (engine/nodes.py) as Kubernetes objects, rendered from the config: the headless Service every set's
pods are the subdomain of, the NetworkPolicy that lets them talk, and the set's Indexed Job, its deadline and
requests those of the stage's one-node Job (pipeline/jobs.py `job_variables`). docs/decisions/multi-node-engine.md;
`docs/decisions/multi-node-engine.yaml` is its rendering for the Kimi config on two H100 nodes:
  python -m eagle3_pipeline.pipeline.engine_sets --config configs/kimi-k2.5-tp8.yaml --image IMAGE [...]
Reads the config; writes YAML to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig, load_config
from eagle3_pipeline.engine.nodes import (
    ENGINE_SERVICE,
    ENGINE_SET_LABEL,
    ENGINE_STAGES,
    MASTER_ADDR_ENV,
    MASTER_PORT,
    NODES_LAUNCHER,
    SET_DIR,
    SET_DIR_ENV,
    SET_ID_ENV,
    EngineSet,
    engine_set,
)
from eagle3_pipeline.pipeline.jobs import job_variables


class Placement(BaseModel):
    """What the cluster gives the set's pods: the image, the GPU nodes, the RDMA resource (None: TCP only)."""
    image: str
    node_selector: dict[str, str] = {}
    rdma_resource: str | None = None  # the RDMA device plugin's resource name, e.g. rdma/ib
    socket_ifname: str = "eth0"
    ib_hca: str = "mlx5"
    namespace: str = "eagle3"


def _labels() -> dict[str, str]:
    return {ENGINE_SET_LABEL: ENGINE_SERVICE}


def service_objects(namespace: str = "eagle3") -> list[dict]:
    """The headless Service every set's pods are the subdomain of, and the NetworkPolicy that lets a set's pods
    reach each other on any TCP port (vLLM's master port, its ZMQ message queues, NCCL's sockets)."""
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": ENGINE_SERVICE, "namespace": namespace,
                            "labels": {"app.kubernetes.io/part-of": "eagle3-pipeline"}},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": _labels(),
                        "ports": [{"name": "vllm-master", "port": MASTER_PORT, "targetPort": MASTER_PORT,
                                   "protocol": "TCP"}]}}
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": {"name": "eagle3-engine-set", "namespace": namespace},
              "spec": {"podSelector": {"matchLabels": _labels()}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": _labels()}}]}]}}
    return [service, policy]


def _env(es: EngineSet, where: Placement) -> list[dict]:
    env = [{"name": SET_ID_ENV, "valueFrom": {"fieldRef": {
               "fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}}},
           {"name": MASTER_ADDR_ENV, "value": f"$({SET_ID_ENV})-0.{ENGINE_SERVICE}"},
           {"name": SET_DIR_ENV, "value": SET_DIR},
           {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "NCCL_SOCKET_IFNAME", "value": where.socket_ifname},
           {"name": "GLOO_SOCKET_IFNAME", "value": where.socket_ifname}]
    if where.rdma_resource:
        env.append({"name": "NCCL_IB_HCA", "value": where.ib_hca})
    return env


def _container(es: EngineSet, jv: dict, where: Placement) -> dict:
    gpus = {"nvidia.com/gpu": es.gpus_per_node, **({where.rdma_resource: 1} if where.rdma_resource else {})}
    caps = {"drop": ["ALL"], **({"add": ["IPC_LOCK"]} if where.rdma_resource else {})}
    return {"name": "prefect-job", "image": where.image, "imagePullPolicy": "IfNotPresent",
            "command": NODES_LAUNCHER, "args": ["prefect", "flow-run", "execute"], "env": _env(es, where),
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": caps},
            "resources": {"requests": {"cpu": jv["cpu_request"], "memory": jv["memory_request"], **gpus},
                          "limits": {"memory": jv["memory_limit"], **gpus}},
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "store", "mountPath": "/data"},
                             {"name": "models", "mountPath": "/models", "readOnly": True}]}


def job_object(config: PipelineConfig, es: EngineSet, where: Placement, shards: int | None = None) -> dict:
    """The set's Indexed Job: `nodes` pods of `gpus_per_node` GPUs, one per node, in the Service's subdomain,
    started through the launcher, failed whole at its first failed or disrupted pod, its deadline and requests
    those of the stage's one-node Job (core/cluster.py job_variables)."""
    jv = job_variables(config, es.stage, shards)
    pod = {"restartPolicy": "Never", "subdomain": ENGINE_SERVICE, "terminationGracePeriodSeconds": 300,
           "priorityClassName": "eagle3-gpu", "serviceAccountName": "eagle3-job",
           "automountServiceAccountToken": False, "nodeSelector": dict(where.node_selector),
           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
           "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                          "whenUnsatisfiable": "DoNotSchedule",
                                          "labelSelector": {"matchLabels": _labels()},
                                          "matchLabelKeys": ["batch.kubernetes.io/job-name"]}],
           "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                               "fsGroupChangePolicy": "OnRootMismatch"},
           "containers": [_container(es, jv, where)],
           "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
                       {"name": "store", "persistentVolumeClaim": {"claimName": "eagle3-store"}},
                       {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}]}
    failure = [{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
               {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"generateName": "eagle3-", "namespace": where.namespace, "generation": 1,
                         "labels": {"prefect.io/flow-name": f"{es.stage}-group" if es.stage == "extract"
                                    else f"{es.stage}-stage"}},
            "spec": {"activeDeadlineSeconds": jv["deadline_seconds"], "backoffLimit": 1, "podFailurePolicy":
                     {"rules": failure}, "parallelism": es.nodes, "completions": es.nodes,
                     "completionMode": "Indexed", "ttlSecondsAfterFinished": 86400,
                     "template": {"metadata": {"labels": _labels(), "annotations": {
                         "karpenter.sh/do-not-disrupt": "true",
                         "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}}, "spec": pod}}}


def manifests(config: PipelineConfig, es: EngineSet, where: Placement, shards: int | None = None) -> list[dict]:
    return [*service_objects(where.namespace), job_object(config, es, where, shards)]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eagle3_pipeline.pipeline.engine_sets",
                                description="an engine set's Kubernetes objects, rendered from a config")
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], dest="overrides", help="key=value, as `eagle3 run`")
    p.add_argument("--stage", default="extract", choices=ENGINE_STAGES)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--split", default="pp", choices=("pp", "tp"))
    p.add_argument("--shards", type=int, default=None, help="an extract group's shards (extract.shard_timeout_s)")
    p.add_argument("--image", required=True)
    p.add_argument("--node-selector", default="{}", help="the GPU nodes' selector, as JSON")
    p.add_argument("--rdma-resource", default=None, help="the RDMA device plugin's resource (default: rdma/ib "
                   "for --split tp, none for pp)")
    return p.parse_args(argv)


def render(argv: list[str]) -> str:

    a = _parse(argv)
    config = load_config(Path(a.config), a.overrides)
    es = engine_set(config, a.stage, a.nodes, a.split, master_addr=f"$({SET_ID_ENV})-0.{ENGINE_SERVICE}")
    rdma = a.rdma_resource or ("rdma/ib" if a.split == "tp" else None)
    where = Placement(image=a.image, node_selector=json.loads(a.node_selector), rdma_resource=rdma)
    return yaml.safe_dump_all(manifests(config, es, where, a.shards), sort_keys=False)


def main(argv: list[str]) -> int:
    sys.stdout.write(render(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
