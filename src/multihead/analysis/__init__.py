"""Reports about runs.

Comparing finished runs (``scripts/compare.py``, :mod:`.comparison`) is one pipeline, the
same for translation, the long-context LM and MQAR, each stage a module that uses only those
before it: runs loaded (:mod:`.runs`), grouped (:mod:`.groups`: designs, learning-rate
grids, pools of seeds checked), described (:mod:`.describe`: each design's equal terms,
counted from its model), tested (:mod:`.tested`, with the statistics of
:mod:`.significance`: each design against its baseline over seeds, Holm over the family of
tests declared in a file before the runs, the order at the last two evaluations), reported
(:mod:`.report`, :mod:`.plots`, :mod:`.wandb_log`); :mod:`.speed` measures runs side by side
for it.

Beside it: learning curves against wall-clock minutes (:mod:`.learning_curve`), attention
maps and head diversity (also drawn during training by the callback
:class:`~multihead.analysis.diagnostics.AttentionMapLogger`, which is why it lives here and
not in :mod:`multihead.training`), bertviz views (:mod:`.views`), which heads matter
(importance, roles, pruning curves); and :mod:`.conversion_study`, which converts a trained
MHA checkpoint to GQA and MLA at set cache ratios, scores, uptrains (``scripts/train.py``)
and scores again (issue 56)."""
