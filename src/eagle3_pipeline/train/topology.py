"""Where the train stage's ranks run, and what one optimizer step sees.

Owns `Topology` (nodes x ranks per node, accumulation steps, the global batch in tokens), `TrainSet` (the torchrun
agent command of every node of a multi-node set, meeting through torchrun's own c10d rendezvous), `train_set`
(the set for this config: a Kubernetes Indexed Job's pods, told by the environment the job template sets, or
agents on 127.0.0.1), and `fit` (the run's estimated duration against the stage's deadline). Light imports only.
Reads the environment; writes nothing (the stage publishes a cluster set's record for the other pods).
"""

from __future__ import annotations

import math
import os
import sys
import uuid
from collections.abc import Mapping

from pydantic import BaseModel

from eagle3_pipeline.core.config import TrainConfig
from eagle3_pipeline.core.ports import free_port

WORKER = "eagle3_pipeline.train.worker"
# Set by the GPU job template for a train set's pods (infra/k8s-gpu-job-template.json, docs/kubernetes.md):
RDZV_ID_ENV = "EAGLE3_TRAIN_RDZV_ID"              # the set's id: its Job's name (the pod's job-name label)
SERVICE_ENV = "EAGLE3_TRAIN_SERVICE"              # the headless Service its pods are the subdomain of
NODE_RANK_ENV = "JOB_COMPLETION_INDEX"            # this pod's index, as Kubernetes sets it in an Indexed Job
RDZV_ENDPOINT_ENV = "EAGLE3_TRAIN_RDZV_ENDPOINT"  # host:port of node 0's c10d store; default <id>-0.<service>:<port>
LOCAL_ADDR_ENV = "EAGLE3_TRAIN_LOCAL_ADDR"        # the address other pods reach this one at (its pod IP)
SET_DIR_ENV = "EAGLE3_TRAIN_SET_DIR"              # where node 0 publishes the set's record for the others


class Topology(BaseModel):
    """What report.json and the train record say about where the draft was trained."""
    nodes: int
    ranks_per_node: int
    accumulation_steps: int  # packed rows each rank trains on per optimizer step
    global_batch_tokens: int  # tokens (packed rows of max_seq_len) per optimizer step over every rank
    rows_per_step: int  # ranks x accumulation_steps
    sharding: str = "ddp"  # how the ranks hold the draft: ddp (a copy each) or fsdp (sharded; train.sharding)


def topology(cfg: TrainConfig) -> Topology:
    a = cfg.accumulation_steps
    return Topology(nodes=cfg.nodes, ranks_per_node=cfg.world_size, accumulation_steps=a,
                    global_batch_tokens=cfg.batch_tokens, rows_per_step=cfg.ranks * a, sharding=cfg.sharding)


class TrainSet(BaseModel):
    """A multi-node set: one torchrun agent command per node (argv[i] runs node i). `local`: every agent is a
    child of this machine (no cluster); else this process runs `argv[node_rank]` and the other pods theirs."""
    id: str
    endpoint: str
    nodes: int
    argv: list[list[str]]
    local: bool
    node_rank: int = 0


def agent_argv(cfg: TrainConfig, endpoint: str, set_id: str, node_rank: int, local_addr: str | None,
               job_path: str) -> list[str]:
    """One node's torchrun agent: c10d rendezvous at `endpoint`, node 0 hosting its store (is_host, so that
    agents sharing a machine never race for it), no restarts in place (a failed set is a failed attempt; the
    next one resumes from the last checkpoint)."""
    conf = f"join_timeout={int(cfg.rdzv_timeout_s)},is_host={int(node_rank == 0)}"
    return [sys.executable, "-u", "-m", "torch.distributed.run", f"--nnodes={cfg.nodes}",
            f"--nproc-per-node={cfg.world_size}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={set_id}", f"--rdzv-conf={conf}", f"--node-rank={node_rank}", "--max-restarts=0",
            *([f"--local-addr={local_addr}"] if local_addr else []), "-m", WORKER, job_path]


def train_set(cfg: TrainConfig, job_path: str, environ: Mapping[str, str] = os.environ) -> TrainSet | None:
    """The set this config trains on, or None for one node. In a pod of a train set (RDZV_ID_ENV set by the GPU job
    template, NODE_RANK_ENV by Kubernetes) the agents are that set's pods; elsewhere `nodes` agents on 127.0.0.1."""
    if cfg.nodes == 1:
        return None
    set_id, index = environ.get(RDZV_ID_ENV, "").strip(), environ.get(NODE_RANK_ENV)
    endpoint = environ.get(RDZV_ENDPOINT_ENV, "").strip()
    if set_id and index is None and not endpoint:
        raise RuntimeError(f"train.nodes={cfg.nodes} in a pod that is not an Indexed Job's ({NODE_RANK_ENV} unset): the "
                           f"train stage's Job needs jobs.job_variables' train set variables")
    if set_id and not endpoint:
        endpoint = f"{set_id}-0.{environ.get(SERVICE_ENV) or 'eagle3-train'}:{cfg.rdzv_port}"
    if endpoint:
        set_id = set_id or "eagle3-train"
        rank = int(index or 0)
        addr = environ.get(LOCAL_ADDR_ENV) or None
        argv = [agent_argv(cfg, endpoint, set_id, i, addr if i == rank else None, job_path) for i in range(cfg.nodes)]
        return TrainSet(id=set_id, endpoint=endpoint, nodes=cfg.nodes, argv=argv, local=False, node_rank=rank)
    endpoint, set_id = f"127.0.0.1:{free_port()}", f"local-{uuid.uuid4().hex[:12]}"
    argv = [agent_argv(cfg, endpoint, set_id, i, "127.0.0.1", job_path) for i in range(cfg.nodes)]
    return TrainSet(id=set_id, endpoint=endpoint, nodes=cfg.nodes, argv=argv, local=True)


class Fit(BaseModel):
    """The run's duration, estimated from its first timed steps, against the stage's deadline."""
    tokens_per_s: float
    steps_left: int
    estimated_s: float  # the whole run's training at the measured rate (steps done before this attempt excluded)
    deadline_s: float
    fits: bool
    nodes_to_fit: int | None  # the node count whose rate would end within the deadline (None: it fits)


def fit(cfg: TrainConfig, tokens_per_s: float, step_s: float, steps_left: int, elapsed_s: float) -> Fit:
    """`steps_left` optimizer steps of `step_s` each (measured; `tokens_per_s` over every rank, for the record),
    after `elapsed_s` of this attempt, against train.timeout_s. The node count that would fit assumes the step time
    shrinks with the nodes (data parallel, the global batch held: fewer accumulation steps), which the report's
    tokens/s per topology lets you check."""
    train_s = steps_left * step_s
    total = elapsed_s + train_s
    fits = total <= cfg.timeout_s
    need = None
    if not fits:
        room = max(cfg.timeout_s - elapsed_s, 1.0)
        need = max(cfg.nodes + 1, math.ceil(cfg.nodes * train_s / room))
    return Fit(tokens_per_s=round(tokens_per_s, 1), steps_left=steps_left, estimated_s=round(total, 1),
               deadline_s=cfg.timeout_s, fits=fits, nodes_to_fit=need)
