"""The preflight stage: before any engine starts, does the target, its layer ids and the budget fit?
stage.py: `preflight` and its PreflightResult.
"""
