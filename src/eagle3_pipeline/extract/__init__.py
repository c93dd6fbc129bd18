"""The extract stage: target model + tokenized rows -> `hidden_states/hs_{i}.safetensors`.

  stage.py      parent side, the glue the flow calls: extract_group, summarize, group_deadline, what the
                version's manifest holds (ExtractResult, ShardRecord, ExtractFailed)
  worker.py     the child process (ExtractJob): one engine, a group of shards
  connector.py  our vLLM KV connector; vLLM's workers import it, nothing here does
Nothing is re-exported here, so `python -m eagle3_pipeline.extract.worker` does not import its own module
twice and nothing heavy is imported in the parent. Shared with other stages, on the ground floor: the
shard plan and version layout (layout.py), the record format and invariance numbers (contracts.py), the
record pool (pool.py) and the shard run: typed manifest, attempts, publishing, recovery (shardrun.py).
"""
