"""Helpers shared by the test suites (never collected as tests):
  store            run-store comparisons (hashes, manifest content, temporaries, tagged processes) and
                   `small_overrides`, the one small-run config used by tests that start many engines
  version          ExtractVersions for tests that run the stage cores on a directory of their own
  chaos            seeded kill trials, the gpu-gate after a kill, the delayed killer
  server           processes and Prefect API calls of the server tests
  draft            a random speculators EAGLE-3 draft (evaluate tests)
  speculators_cpu  speculators' own trainer on CPU (a script: `python tests/helpers/speculators_cpu.py`)
  broken_connector a deliberately wrong hidden-states connector, loaded by vLLM in the engine child
  training         the real trainer on the session's tiny extraction (topology comparisons)
  cputime          a pytest plugin (`-p tests.helpers.cputime`): each test phase's wall, CPU and demand seconds
"""
