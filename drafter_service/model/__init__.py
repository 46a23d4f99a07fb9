"""Optional draft models: CARD query-and-correct candidate caches, loading and distillation."""
