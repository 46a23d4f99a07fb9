"""Token store: ring buffer, suffix index, n-gram tables and their persistence."""
