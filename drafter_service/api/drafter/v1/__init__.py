"""Generated gRPC API code (see scripts/gen_proto.py)."""
