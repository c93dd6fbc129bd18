"""The train stage: offline data + draft vocab (read by records/vocab.py) -> an EAGLE-3 draft that vLLM serves.

  stage.py        parent side: train_draft, make_untrained_draft, TrainResult (what the flow calls)
  job.py          TrainJob, the JOB.json the parent writes and the child reads
  worker.py       the child process (speculators' trainer), `python -m eagle3_pipeline.train.worker`
  export.py       export_check: is a checkpoint the draft we meant
  online.py, online_data.py   online training: hidden states from a running vLLM server
  topology.py     nodes x ranks, the global batch, a multi-node set's torchrun agents, the duration estimate
  nodes.py        a set's agents: on this machine, or a Kubernetes train set's pod (`python -m ...train.nodes`)
  accumulate.py   the child's gradient accumulation and step checkpoints (inside speculators' trainer)
Nothing is re-exported here, so the child does not import the parent's modules.
"""
