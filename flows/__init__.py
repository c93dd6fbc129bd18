"""The Prefect side: the `eagle3` command, the flows and what they deploy. Importing it sets our garbage-collector
thresholds (core/heap.py), for the `eagle3` command and for each flow-run process, which imports a flow from here."""

from eagle3_pipeline.core import heap

heap.tune()
