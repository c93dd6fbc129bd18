"""The verify gate: every record checked before training, and a numeric reference on a few samples.

stage.py is the gate the flow calls; check.py the base of a check (one verdict); learned.py, structure.py,
fingerprint.py, masks.py, invariance.py, prediction.py and row_signal.py the checks; reference.py and worker.py the
recompute with the target; extent.py how far a bad extraction goes. Every file: docs/internals.md, "verify/".
"""
