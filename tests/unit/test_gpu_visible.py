"""The gpu-gate's view of nvidia-smi: CUDA_VISIBLE_DEVICES by index or UUID, and a failure that names
the processes holding the memory (nvidia-smi replaced by canned output: no GPU on these machines)."""

from __future__ import annotations

import pytest

from eagle3_pipeline.gpu import stage as gpu

UUID0 = "GPU-8f2c1d3e-aaaa-bbbb-cccc-000000000000"
UUID1 = "GPU-5b7e9a01-dddd-eeee-ffff-111111111111"
GPUS = f"0, {UUID0}, 30000, 81920\n1, {UUID1}, 3, 81920\n"
APPS = f"{UUID0}, 424242, 29500, /usr/bin/python3\n{UUID1}, 434343, 1, Xorg\n"


@pytest.fixture
def fake_smi(monkeypatch):
    def smi(*query):
        return {"--query-gpu=index,uuid,memory.used,memory.total": GPUS,
                "--query-compute-apps=gpu_uuid,pid,used_memory,process_name": APPS}[query[0]]

    monkeypatch.setattr(gpu, "_smi", smi)
    monkeypatch.setattr(gpu, "_has_smi", lambda: True)
    monkeypatch.setattr(gpu, "find_leftovers", lambda: [])


@pytest.mark.parametrize("visible, expect", [
    (None, [0, 1]), ("0,1", [0, 1]), ("1", [1]), ("1,0", [1, 0]), ("", []),
    (UUID1, [1]), (f"{UUID1},{UUID0}", [1, 0]), ("GPU-5b7e", [1]),  # a unique UUID prefix, as CUDA accepts
    ("GPU-", [])  # ambiguous prefix: CUDA stops there
    , ("0,-1,1", [0]), ("7", []),
])
def test_visible_devices_by_index_or_uuid(fake_smi, monkeypatch, visible, expect):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [g["index"] for g in gpu.gpu_memory()] == expect


def test_busy_gpu_failure_names_the_holding_process(fake_smi, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{UUID0},{UUID1}")
    with pytest.raises(gpu.GpuGateFailed) as e:
        gpu.gpu_gate(wait_s=0, log=lambda _: None)
    msg = str(e.value)
    assert f"GPU 0 ({UUID0}): 30000 of 81920 MiB" in msg and "pid 424242 (/usr/bin/python3): 29500 MiB" in msg
    assert "GPU 1" not in msg  # 3 MiB used: not busy


def test_uuid_selection_ignores_busy_gpus_not_visible(fake_smi, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUID1)
    res = gpu.gpu_gate(wait_s=0, log=lambda _: None)
    assert res.passed and [g["index"] for g in res.gpus] == [1]
