"""The disk tier: block files, their journal, the space they hold and the batched block I/O (compiled, with its Python twin)."""
