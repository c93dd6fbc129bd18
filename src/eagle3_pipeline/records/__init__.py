"""The records room: the files stages hand each other and how they are laid out in the store.

contracts (the hidden-state record format), families (what differs by model family), vocab (the draft
vocabulary's files), layout (an extraction version and its shards), shardrun (a version's manifest: attempts,
publishing, recovery), pool (records shared across versions), lineage, results (the result models of the
stages the report reads: regenerate, extract, vocab, train).
"""
