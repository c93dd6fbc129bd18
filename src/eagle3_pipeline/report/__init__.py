"""The report stage: report.json (its typed model) and report.md from the run's records.

stage.py   builds and writes the report; runs.py reads a store's run history (the τ-over-data points).
"""
