"""Bridges between the layer and other libraries. Each module imports its library itself and
needs its extra (``huggingface``: ``pip install 'multihead[hf]'``); importing this package
imports none of them."""
