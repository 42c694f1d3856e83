"""pdserve's public gRPC API (package pdserve.v1); generated stubs under `pdserve_proto.v1`."""
