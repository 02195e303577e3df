"""Scale-out: the device mesh and how the model and its KV cache are laid on it.

The mesh has two axes, ('data', 'model'). Tensor parallelism shards the model
over 'model' in the Megatron layout, written as GSPMD shardings of the params
(`shardings.py`): attention by heads, the MLP by its hidden dimension, the
embedding and LM head by vocabulary; XLA inserts the two all-reduces per layer
that layout implies. Attention itself runs per shard under `shard_map`, so the
Pallas kernels (custom calls GSPMD cannot split) see only their heads.

Data parallelism replicates the (split) model over 'data' (`data.py`): each
rank serves its own sequences from its own slice of the KV pool, and one
jitted step runs every rank under `shard_map` (manual over 'data' only).

Several hosts (`multihost.py`): one process per host on JAX's distributed
runtime; process 0 schedules and sends each step's host inputs to the others,
which make the same call, and watches that they stay alive.
"""
