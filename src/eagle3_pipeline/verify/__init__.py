"""The verify gate: every record checked before training, and a numeric reference on a few samples.

  stage.py        the gate the flow calls: verify, check_verify_gate, require_verified, VerifyResult
  check.py        a check as a small object: one verdict; the base counts, times and fills its result
  structure.py    every record once: the records' pass, its checks in order, per-layer statistics
  learned.py      the pass's checks: structure, fingerprint, state sketch; identity, predictions, norm bounds
  scan.py         the reader and compute threads over batches of record files
  fingerprint.py  the final layer against the target's own logits (lm_head margins)
  invariance.py   the verdict on the batch-invariance numbers the extract engine measured
  masks.py        token ids and loss masks against the prepared rows they came from
  reference.py    a few samples against the target streamed layer by layer (worker.py: the reference child)
  cache.py        per-record results kept for unchanged records and the record pool
"""
