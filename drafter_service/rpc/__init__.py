"""The gRPC layer: a thin servicer, the server with its error boundary, back-pressure, TLS and health."""
