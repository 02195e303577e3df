"""The gRPC front end of jaxinfer: `jaxinfer serve`, `jaxinfer client`,
`jaxinfer bench serve`, and `serve.client.InferenceClient` for Python.

    serve/proto/jaxinfer/v1   the service definition and its generated code
    serve/wire.py             request decoding that names a field with bad UTF-8
    serve/convert.py          proto <-> engine values, with input checks
    serve/servicer.py         the Inference RPCs over AsyncLLMEngine
    serve/server.py           the grpc.aio server: health, reflection, metrics, shutdown
    serve/client.py           a small blocking client, and the `jaxinfer client` command
    serve/bench.py            `jaxinfer bench serve`: timed streams against a server
    serve/cli.py              the `jaxinfer` console command: jaxinfer.cli's commands + these
"""
