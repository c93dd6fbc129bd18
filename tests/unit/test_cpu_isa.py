"""AMX permission (eagle3_pipeline/cpu_isa.py): vLLM's CPU attention runs AMX tile instructions without
asking the kernel first, and a process that did not ask dies of SIGILL (exit code -4) on its first
short prefill. The permission is cleared by execve, so every process vLLM spawns must ask itself."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json
from eagle3_pipeline.engine import cpu_isa
before = cpu_isa.amx_permitted()
granted = cpu_isa.allow_amx()
print(json.dumps({"supported": cpu_isa.amx_supported(), "before": before, "granted": granted,
                  "after": cpu_isa.amx_permitted(), "again": cpu_isa.allow_amx()}))
"""


def test_allow_amx_is_loaded_by_vllm_in_every_process():
    """Registered in vLLM's general-plugins group, which vLLM loads in its engine core and workers."""
    from importlib.metadata import entry_points

    from eagle3_pipeline.engine.cpu_isa import allow_amx

    ours = {e.value: e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("eagle3_pipeline.")}
    assert set(ours) == {"eagle3_pipeline.engine.cpu_isa:allow_amx", "eagle3_pipeline.engine.prompt_scores:install",
                         "eagle3_pipeline.engine.state_sketch:install", "eagle3_pipeline.engine.runner:install"}
    assert ours["eagle3_pipeline.engine.cpu_isa:allow_amx"].load() is allow_amx


def test_a_fresh_process_gets_amx_where_the_cpu_has_it():
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout)
    if out["supported"]:  # a new process starts without the permission; asking grants it, twice is harmless
        assert out == {"supported": True, "before": False, "granted": True, "after": True, "again": True}, out
    else:  # no AMX (or not Linux x86-64): nothing to ask for, and asking neither fails nor claims it
        assert out == {"supported": False, "before": False, "granted": False, "after": False, "again": False}, out


def test_a_child_killed_by_a_signal_is_named_by_it():
    from eagle3_pipeline.core.proc import exit_code

    assert exit_code(-4) == "code -4 (SIGILL)" and exit_code(-9) == "code -9 (SIGKILL)"
    assert exit_code(1) == "code 1" and exit_code(None) == "code None"
