"""The regenerate stage (optional, before prepare): the target answers the conversations' turns itself.

  stage.py     parent side: regenerate, prepare_config, RegenerateResult; its shard run (shardrun.py)
  job.py       RegenerateJob, the JOB.json the parent writes and the child reads; shard files
  worker.py    the child process: one vLLM engine answers every unpublished shard's turns
  turns.py     which turns are answered, kept or quarantined, and how each row is rebuilt
Nothing is re-exported here, so the child does not import the parent's modules.
"""
