"""The running process: the service, its servers, Redis and the background jobs, started and stopped together."""
