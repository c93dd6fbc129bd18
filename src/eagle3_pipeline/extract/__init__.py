"""The extract stage: target model + tokenized rows -> `hidden_states/hs_{i}.safetensors`.

Owns, by module (nothing is re-exported here, so `python -m eagle3_pipeline.extract.worker` does not
import its own module twice, and nothing heavy is imported in the parent):
  shards.py     parent side: plan_shards, extract_group, extract, summarize, the Manifest and the
                ExtractResult / ShardRecord / Shard / ExtractFailed records
  worker.py     the child process (ExtractJob, to_record): one engine, a group of shards
  connector.py  our vLLM KV connector; vLLM's workers import it, nothing here does.
The captured layer ids and model dims come from `contracts` (resolve_layer_ids, model_dims).
"""
