"""The kvstore daemon: gRPC service over the tiered store."""
