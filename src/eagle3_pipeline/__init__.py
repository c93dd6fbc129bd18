"""eagle3-pipeline core: plain, typed functions for every stage. No Prefect imports here."""

__version__ = "0.1.0"
FORMAT_VERSION = 1  # bump when the bytes of any artifact change for the same inputs
