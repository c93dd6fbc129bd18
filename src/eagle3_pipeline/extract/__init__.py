"""The extract stage: target model + tokenized rows -> `hidden_states/hs_{i}.safetensors`.

Public API (heavy imports stay lazy: vLLM is only imported inside the child process):
  plan_shards, extract_group, extract, summarize   -- shards.py (parent side, manifest)
  ExtractResult, ShardRecord, Shard, ExtractFailed -- shards.py records
  captured_layer_ids, model_dims                   -- layers.py
  to_record, ExtractJob                            -- worker.py (the child: python -m ...extract.worker JOB.json)
connector.py holds our vLLM KV connector; it is imported by vLLM's workers, never from here.
"""

from eagle3_pipeline.extract.layers import ModelDims, captured_layer_ids, model_dims
from eagle3_pipeline.extract.shards import (
    ExtractFailed,
    ExtractResult,
    Manifest,
    Shard,
    ShardRecord,
    extract,
    extract_group,
    plan_shards,
    summarize,
)
from eagle3_pipeline.extract.worker import ExtractJob, to_record

__all__ = [
    "ExtractFailed", "ExtractJob", "ExtractResult", "Manifest", "ModelDims", "Shard", "ShardRecord",
    "captured_layer_ids", "extract", "extract_group", "model_dims", "plan_shards", "summarize", "to_record",
]
