"""The vocab stage: the draft vocabulary (d2t / t2d) from prepare's token frequencies. stage.py: `build_vocab`
and its VocabResult. The files' readers and their check, which train uses, are records/vocab.py.
"""
