"""The pipeline room, above every stage: what puts the stages together.

  registry.py         STAGES, every stage's StageSpec once in run order; the lists that name stages read it
  stages.py           one stage_<name> function per stage: the glue the tasks (tasks/stage_tasks.py) call
  online_training.py  train.mode online: the verify gate on rows from the server the trainer then reads
  window_training.py  train.mode window: capture (extract + verify per shard) and the trainer through a window
  store_gc.py         `eagle3 gc`: what every stage keeps in the run store, swept
  jobs.py             the Kubernetes Job of each stage that runs as its own (JOB_STAGES): its job variables
  engine_sets.py      an engine stage over several nodes (engine/nodes.py) as Kubernetes objects, from the config
Nothing below this room imports it (tests/unit/test_architecture.py).
"""
