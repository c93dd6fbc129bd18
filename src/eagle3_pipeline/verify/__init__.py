"""The verify gate: structure of every record, numeric reference against HF transformers."""
