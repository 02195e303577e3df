"""`jaxinfer bench`: latency, offline throughput and serving benchmarks.

A benchmark is a seeded synthetic workload of exact token ids and exact
output lengths (`workloads`), run through jaxinfer (`latency`, `offline`
via `LLM.generate`; `serving` over gRPC) and optionally through llama.cpp
on the same GGUF (`llama_cpp_peer`), summarized by plain arithmetic
(`stats`), set against measured machine peaks (`roofline`), and printed,
written as JSON and plotted (`report`, `plot`). `cli` holds the flags and
`modes` the end-to-end run of each mode.

Timings are wall-clock: on a shared machine compare figures within one run.
"""
