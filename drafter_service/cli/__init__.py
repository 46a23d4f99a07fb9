"""The drafter command line: serve, warm, ingest, stats, import-corpus, frozen, distill-draft and bench."""
