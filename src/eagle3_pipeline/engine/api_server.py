"""The online server's process: vLLM's OpenAI-compatible server module, run as `python -m` would run it, from a module
of ours so that a fork server may start it (core/forkserver.py forks only our modules that say what to preload).
Nothing else: the arguments, the process and what it spawns are vLLM's own. docs/internals.md, "engine/api_server.py".
"""

from __future__ import annotations

import runpy

SERVER = "vllm.entrypoints.openai.api_server"  # engine/surface.py checks that the installed vLLM has it
FORK_PRELOAD = (SERVER,)  # what a fork server imports before forking a server (the import is most of its start)

if __name__ == "__main__":
    runpy.run_module(SERVER, run_name="__main__", alter_sys=True)
