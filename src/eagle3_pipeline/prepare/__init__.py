"""The prepare stage: chat rows in, a tokenized dataset version out (loss masks, token frequencies, quarantine).
stage.py: `prepare`. Its record and readers, which the later stages use, are data/tokenized.py.
"""
