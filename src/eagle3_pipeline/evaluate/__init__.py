"""The evaluate stage (a gate): how many draft tokens the target accepts when vLLM serves the draft.

  stage.py     parent side: evaluate_pair, evaluate_draft, compare_drafts, check_acceptance_gate, the reports
  results.py   per-run records and the pure counters -> rates arithmetic (τ, per position, speed-up)
  ngram.py     vLLM's n-gram speculation as the baseline: its tokens per decode step
  prompts.py   the evaluation prompts: a PromptSet of rendered token ids with a category each
  worker.py    the child process (EvalJob in, RunOutput per run out): one vLLM engine per run
Nothing is re-exported here, so the child does not import the parent's modules.
"""
