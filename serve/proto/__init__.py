"""Protocol buffers of the jaxinfer gRPC service (generated code is checked in)."""
