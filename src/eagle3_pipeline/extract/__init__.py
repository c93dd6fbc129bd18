"""The extract stage: target model + tokenized rows -> `hidden_states/hs_{i}.safetensors`.

Public API (names resolved lazily, so `python -m eagle3_pipeline.extract.worker` does not import
its own module twice, and nothing heavy is imported in the parent):
  plan_shards, extract_group, extract, summarize, Manifest  -- shards.py (parent side, manifest)
  ExtractResult, ShardRecord, Shard, ExtractFailed          -- shards.py records
  captured_layer_ids, model_dims, ModelDims                 -- layers.py
  to_record, ExtractJob                                     -- worker.py (the child process)
connector.py holds our vLLM KV connector; vLLM's workers import it, nothing here does.
"""

from importlib import import_module

_WHERE = {
    **dict.fromkeys(["ExtractFailed", "ExtractResult", "Manifest", "Shard", "ShardRecord", "extract",
                     "extract_group", "plan_shards", "summarize"], "shards"),
    **dict.fromkeys(["ModelDims", "captured_layer_ids", "model_dims"], "layers"),
    **dict.fromkeys(["ExtractJob", "to_record"], "worker"),
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
