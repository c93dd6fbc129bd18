"""Hub token from a Prefect Secret block, for flows and the CLI (the core never imports Prefect).

A config names the Secret block (`target.hub_token_secret`) and the environment variable the core
reads (`target.hub_token_env`, default HF_TOKEN). `use_hub_secret` loads the block's value into that
variable of this process, once, before any stage touches the hub; child processes (engines, the
trainer) inherit it. A value already in the environment wins, so a worker can be given the token
directly. The token itself is never printed, logged or written: only the block and variable names.
"""

from __future__ import annotations

import os

from eagle3_pipeline.core.config import PipelineConfig


def use_hub_secret(config: PipelineConfig, log=print) -> bool:
    """Put the configured Secret block's value into `target.hub_token_env`; True when it did."""
    target = config.target
    if not target.hub_token_secret or os.environ.get(target.hub_token_env):
        return False
    from prefect.blocks.system import Secret  # noqa: PLC0415  heavy: prefect (the CLI imports this module)

    value = Secret.load(target.hub_token_secret).get()
    if not isinstance(value, str) or not value:
        raise ValueError(f"Prefect Secret block {target.hub_token_secret!r}: expected a non-empty string token")
    os.environ[target.hub_token_env] = value
    log(f"hub token: from Secret block {target.hub_token_secret!r} into ${target.hub_token_env}")
    return True
