"""Running the model: weights and checkpoints (catalog, GGUF, int8), the model runner, its decode path
(eager, C step) and attention, sparse attention with its indexers, importance scores, selected memory,
and sampling."""
