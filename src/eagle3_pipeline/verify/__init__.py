"""The verify gate: every record checked before training, and a numeric reference on a few samples.

  stage.py        the gate the flow calls: verify, check_verify_gate, require_verified, VerifyResult
  structure.py    every record once: structure, statistics, norm bounds, layer identity (StructureCheck)
  scan.py         the reader and compute threads over batches of record files
  fingerprint.py  the final layer against the target's own logits (lm_head margins)
  identity.py     layer-identity signatures: does each captured slot look like its layer
  invariance.py   the verdict on the batch-invariance numbers the extract engine measured
  masks.py        token ids and loss masks against the prepared rows they came from
  reference.py    a few samples against the target streamed layer by layer (in worker.py's child)
  cache.py        per-record results kept for unchanged records and the record pool
  worker.py       the reference child process
"""
