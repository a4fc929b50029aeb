"""A checkpoint's life after training: export to CTranslate2 and translate with the export.

:mod:`multihead.checkpoints.export` writes a CTranslate2 model directory from any checkpoint
``scripts/train.py`` saves; :mod:`multihead.checkpoints.engine` translates with such a
directory under the length rules of our own decoder (``scripts/translate.py
engine=ctranslate2``). Reading checkpoints still lives in ``multihead.training.checkpoint``.
"""
