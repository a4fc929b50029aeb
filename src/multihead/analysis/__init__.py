"""Reports about runs: comparing finished runs (read by :mod:`.runs`, tested against MHA
per seed and over seeds with Holm's correction by :mod:`.against_mha` and
:mod:`.significance`, measured side by side by :mod:`.speed`, written by :mod:`.report`,
:mod:`.plots` and :mod:`.wandb_log`, in that order by :mod:`.comparison`), learning curves
against wall-clock minutes, attention maps and head diversity (also drawn during training
by the callback :class:`~multihead.analysis.diagnostics.AttentionMapLogger`, which is why it
lives here and not in :mod:`multihead.training`), and which heads matter (importance,
roles, pruning curves); and :mod:`.conversion_study`, which converts a trained MHA
checkpoint to GQA and MLA at set cache ratios, scores, uptrains (``scripts/train.py``)
and scores again (issue 56)."""
