"""drafter's service side: sessions, the drafting policy, the gRPC server and its runtime, benchmarks, CLI."""
