"""The drafting core: sessions, the drafter of one namespace, the tree builder and its acceptance model."""
