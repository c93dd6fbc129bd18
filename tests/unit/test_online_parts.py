"""The parts of online training that need no running engine: which rows the gate samples, the server's
JSON logprobs as fingerprint input, the server command line, and the background child that holds it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import ExtractConfig, TargetConfig
from eagle3_pipeline.core.proc import BackgroundChild
from eagle3_pipeline.records.contracts import FP_IDS_KEY, FP_LOGPROBS_KEY, fingerprint_from_logprobs
from eagle3_pipeline.train.online import _last_logprobs, _prompt_logprobs, sample_rows


def test_sample_rows_spread_over_the_dataset():
    assert sample_rows(10, 64) == list(range(10))
    rows = sample_rows(1000, 24)
    assert len(rows) == 24 and rows[0] == 0 and rows[-1] == 999 and rows == sorted(set(rows))
    gaps = {b - a for a, b in zip(rows, rows[1:])}
    assert max(gaps) - min(gaps) <= 1  # evenly spaced
    assert sample_rows(5, 1) == [0]


def test_server_logprobs_become_the_fingerprint_the_extract_engine_writes():
    """The same tensors as from vLLM's in-process RequestOutput: ids by rank 1, 2 per position, the
    prompt token's own entry (rank 437) ignored, the generated token's top-2 ranked by logprob."""
    prompt = [None,
              {"5": {"logprob": -14.4, "rank": 437, "decoded_token": "x"}, "403": {"logprob": -0.82, "rank": 1},
               "549": {"logprob": -1.23, "rank": 2}},
              {"375": {"logprob": -1.65, "rank": 1}, "540": {"logprob": -1.68, "rank": 2}}]
    last = {"top_logprobs": [{"token_id:20": -2.06, "token_id:403": -1.03}]}
    fp = fingerprint_from_logprobs(_prompt_logprobs(prompt), _last_logprobs(last), 3)
    assert fp[FP_IDS_KEY].tolist() == [[403, 549], [375, 540], [403, 20]]
    assert fp[FP_LOGPROBS_KEY][2].tolist() == pytest.approx([-1.03, -2.06])
    assert _last_logprobs(None) is None and _last_logprobs({"top_logprobs": [None]}) is None
    # the lean prompt-scores path leaves the prompt token's rank uncounted (-1): still not a top-2 entry
    prompt[1]["5"]["rank"] = -1
    fp = fingerprint_from_logprobs(_prompt_logprobs(prompt), _last_logprobs(last), 3)
    assert fp[FP_IDS_KEY].tolist() == [[403, 549], [375, 540], [403, 20]]


def test_server_argv_carries_the_engine_settings(tmp_path):
    from eagle3_pipeline.engine.build import (
        CPU_ONE_PROCESS_EXECUTOR,
        extract_hidden_states_config,
        server_argv,
        vllm_is_cpu_build,
    )

    argv = server_argv(ExtractConfig(gpu_memory_utilization=0.2), TargetConfig(model="/m", trust_remote_code=True),
                       max_model_len=600, port=8123, speculative_config=extract_hidden_states_config([2, 4, 8]),
                       max_num_seqs=8, enable_chunked_prefill=False, enable_prefix_caching=False)
    assert argv[1:4] == ["-u", "-m", "eagle3_pipeline.engine.api_server"]  # vLLM's server module, run by ours
    opt = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--") and not argv[i + 1].startswith("--")}
    assert opt["--model"] == "/m" and opt["--port"] == "8123" and opt["--max-model-len"] == "600"
    assert opt["--gpu-memory-utilization"] == "0.2" and opt["--max-num-seqs"] == "8" and opt["--seed"] == "0"
    assert json.loads(opt["--speculative-config"])["draft_model_config"]["hf_config"][
        "eagle_aux_hidden_state_layer_ids"] == [2, 4, 8]
    assert {"--trust-remote-code", "--enforce-eager", "--no-enable-chunked-prefill",
            "--no-enable-prefix-caching"} <= set(argv)
    assert "--kv-transfer-config" not in argv  # not given: not passed
    # vLLM's own parser accepts every option we build
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[4:])
    assert args.max_num_seqs == 8 and args.enable_chunked_prefill is False and args.trust_remote_code is True
    # one rank on the CPU build: vLLM's one-process executor by its class name (build.cpu_executor_kwargs), which
    # vLLM resolves to that class; more ranks keep vLLM's choice (tests/integration/test_online.py counts the
    # server's processes)
    if vllm_is_cpu_build():
        from types import SimpleNamespace

        from vllm.v1.executor.abstract import Executor
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        assert args.distributed_executor_backend == CPU_ONE_PROCESS_EXECUTOR
        named = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=CPU_ONE_PROCESS_EXECUTOR))
        assert Executor.get_class(named) is UniProcExecutor
    else:
        assert "--distributed-executor-backend" not in argv
    tp2 = server_argv(ExtractConfig(tensor_parallel_size=2), TargetConfig(model="/m"), max_model_len=600, port=1)
    assert "--distributed-executor-backend" not in tp2
    # an MLA target in float32 (engine.cpu_mla_kwargs): the backend's option and name parse too
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 99, "kv_lora_rank": 512}))
    mla = server_argv(ExtractConfig(), TargetConfig(model=str(tmp_path), dtype="float32"), max_model_len=600, port=1)
    assert "--attention-backend" not in argv
    if "--attention-backend" in mla:  # the CPU build
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(mla[4:])
        assert str(args.attention_backend).endswith("CPU_MLA")


def test_background_child_is_ended_with_its_group(tmp_path):
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
             "print('up', flush=True); time.sleep(600)"
    with BackgroundChild([sys.executable, "-c", script], name="bg-test", log_path=tmp_path / "bg.log") as bg:
        deadline = time.time() + 30
        while "up" not in bg.tail and time.time() < deadline:
            time.sleep(0.05)
        assert bg.alive() and "up" in bg.tail
        pgid = bg.proc.pid
    import os

    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # the child and its grandchild are gone
    assert "up" in (tmp_path / "bg.log").read_text()


def test_background_child_that_dies_says_why(tmp_path):
    with BackgroundChild([sys.executable, "-c", "print('boom: no such model'); raise SystemExit(3)"],
                         name="bg-dies", log_path=tmp_path / "bg.log") as bg:
        bg.proc.wait(timeout=30)
        time.sleep(0.2)
        assert not bg.alive()
        msg = bg.describe_exit()
    assert "bg-dies exited with code 3" in msg and "boom: no such model" in msg and str(tmp_path / "bg.log") in msg


def test_a_server_that_cannot_start_names_the_cause(tiny_target, tmp_path, monkeypatch):
    """A target directory without weights: the server dies during start-up; the stage says so with the
    server's own last lines, instead of waiting for its start-up deadline.

    Its first port is taken between the pick and the server's bind (CI once lost a run to that race, another
    test's process took it): that start is tried again on another port, and the second names the real cause."""
    import shutil
    import socket

    from eagle3_pipeline.records.contracts import model_dims
    from eagle3_pipeline.records.layout import ExtractVersion
    from eagle3_pipeline.train import online
    from eagle3_pipeline.train.online import ADDRESS_IN_USE, HiddenStateServer, OnlineServerFailed

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    picks = [taken]
    real_pick = online.free_port
    monkeypatch.setattr(online, "free_port", lambda: picks.pop(0) if picks else real_pick())

    model = tmp_path / "no-weights"
    model.mkdir()
    for f in Path(tiny_target).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, model / f.name)
    target = TargetConfig(model=str(model))
    version = ExtractVersion(content_key="k", dir=str(tmp_path / "v"), prepare_version="p", tokenized_dir=str(tmp_path),
                             layer_ids=[2, 4, 5, 8], dims=model_dims(TargetConfig(model=str(tiny_target))), rows=1,
                             rows_per_shard=1, shards=[], groups=[])
    lines: list[str] = []
    with holder, pytest.raises(OnlineServerFailed) as ei:
        with HiddenStateServer(ExtractConfig(), target, version, tmp_path / "work", max_model_len=256,
                               start_timeout_s=600, log=lines.append):
            pass
    msg = str(ei.value)
    assert not isinstance(ei.value, online.PortTaken), msg
    retried = [m for m in lines if "was taken by another process" in m]
    assert len(retried) == 1 and f"port {taken} " in retried[0] and "try 2 of 3" in retried[0], lines
    assert ADDRESS_IN_USE in (tmp_path / "work" / f"server.port-{taken}-taken.log").read_text()
    assert "died while starting" in msg and "server.log" in msg and "exited with code" in msg, msg
    assert "first error in the log: RuntimeError: Cannot find any model weights" in msg, msg
    assert not (tmp_path / "work" / "server_hidden_states").exists()
