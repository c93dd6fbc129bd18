"""The core room: what every other part of the pipeline stands on, and nothing of the pipeline's own.

config (the pydantic configs), store (content keys, atomic writes, locks), store_check (the store's
contract on every host), proc (child processes and their ends), errors (exit codes and the error kinds),
signals, faults (test hooks), progress (the console cadence), cluster (start deadlines and job variables).
"""
