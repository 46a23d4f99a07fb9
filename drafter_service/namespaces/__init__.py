"""A namespace at run time: its drafter, frozen tables and durable request log (spool and follower)."""
