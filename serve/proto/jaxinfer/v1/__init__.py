"""jaxinfer.v1 messages and stubs: `from serve.proto.jaxinfer.v1 import inference_pb2,
inference_pb2_grpc`. Regenerate with `python -m serve.gen_proto`."""
