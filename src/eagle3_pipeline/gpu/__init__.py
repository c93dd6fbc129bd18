"""The GPU gate between stages: leftover processes on the node's accelerators are ended, and the gate
fails loud when it cannot free them. stage.py: `gpu_gate` and its record.
"""
