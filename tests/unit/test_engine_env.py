from eagle3_pipeline.engine_env import cpu_bind_spec, engine_env


def test_cpu_bind_spec_splits_cores_per_tp_rank():
    assert cpu_bind_spec("all", 1, [1, 0]) == "0,1"
    assert cpu_bind_spec("all", 2, [0, 1, 2, 3]) == "0,1|2,3"
    assert cpu_bind_spec("all", 2, [0]) == "0|0"  # more ranks than cores: ranks share the last core
    assert cpu_bind_spec("0-3", 1, [0, 1]) == "0-3"


def test_engine_env_in_process_needs_passive_openmp(monkeypatch):
    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(k, raising=False)
    env = engine_env(None, 1, "all")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "VLLM_CPU_OMP_THREADS_BIND" in env
    separate = engine_env(False, 1, None)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in separate and "OMP_WAIT_POLICY" not in separate
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_env(None, 2, None)  # TP>1: vLLM's own processes
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert engine_env(True, 1, None)["OMP_WAIT_POLICY"] == "ACTIVE"  # the caller's environment wins
