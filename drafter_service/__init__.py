"""drafter's service side: sessions, the drafting policy, benchmarks and (later) the gRPC server."""
