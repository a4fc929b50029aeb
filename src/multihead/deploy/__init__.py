"""Deployment with CTranslate2: :mod:`multihead.deploy.export` writes a CTranslate2 model
directory from a checkpoint (``scripts/export.py format=ctranslate2``), and
:mod:`multihead.deploy.engine` translates with such a directory under the length rules of
our own decoder (``scripts/translate.py engine=ctranslate2``). ``ctranslate2`` (the
``deploy`` extra) is imported only when one of them runs.
"""
