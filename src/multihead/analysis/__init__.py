"""Reports about finished runs: comparing runs, learning curves against wall-clock minutes,
attention maps and head diversity (which training's ``AttentionMapLogger`` also draws after
validation), and which heads matter (importance, roles, pruning curves)."""
