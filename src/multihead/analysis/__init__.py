"""Reports about finished runs: comparing runs (with sacreBLEU's paired significance tests
against MHA, Student-t intervals over seeds, and speeds measured again side by side),
learning curves against wall-clock minutes, attention maps and head diversity (which
training's ``AttentionMapLogger`` also draws after validation), and which heads matter
(importance, roles, pruning curves)."""
