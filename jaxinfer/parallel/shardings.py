"""Tensor-parallel layout of the params, the KV pool and per-sequence vocab state.

Megatron's layout, as GSPMD shardings over the mesh axis 'model' (matrices are
stored [out, in], layer weights with a leading layer axis):

- q_proj, gate_proj, up_proj (and the q/k/v biases): by output row (column
  parallel): each shard makes its heads, its part of the MLP hidden state;
- k_proj, v_proj: by output row, i.e. by KV head: each shard owns its KV heads
  and their cache;
- o_proj, down_proj: by input column (row parallel): partial sums, one
  all-reduce each;
- embed, lm_head: by vocabulary row: each shard holds V / TP rows, logits stay split;
- norms: replicated.

A model with fewer KV heads than shards (Gemma 3 270M has one) gets its K/V
projections repeated so that each shard holds one copy of the head its query
heads read (`expand_kv_heads`): the cache then splits by head like any other,
each shard storing its head's K/V, as vLLM does. Quantized weights split the same
way: values and scales (and int4 offsets) by output row for column-parallel
weights; by input column (scales by group, or replicated for one group per row)
for row-parallel ones, with an AWQ input scale split with its columns. A weight
whose split does not divide evenly stays replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.model.quant import QuantizedWeight
from jaxinfer.parallel.mesh import model_shards

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
BIASES = ("q_bias", "k_bias", "v_bias")
MODEL = "model"
DATA = "data"


def check_tensor_parallel(config: ModelConfig, shards: int) -> None:
    """Raise ConfigError unless the model's heads split over `shards`."""
    if config.num_heads % shards:
        raise ConfigError(
            f"tensor_parallel_size ({shards}) must divide the model's {config.num_heads} "
            f"attention heads")
    kv = config.num_kv_heads
    if kv % shards and shards % kv:
        raise ConfigError(
            f"tensor_parallel_size ({shards}) must divide the model's {kv} KV heads or be a "
            f"multiple of them")


def sharded_config(config: ModelConfig, shards: int) -> ModelConfig:
    """The config the sharded model runs: KV heads repeated up to `shards` when fewer."""
    if config.num_kv_heads >= shards:
        return config
    return dataclasses.replace(config, num_kv_heads=shards)


def expand_kv_heads(params: Params, config: ModelConfig, shards: int) -> Params:
    """Repeat each KV head's K/V projection rows shards / num_kv_heads times, in order,
    so shard i holds a copy of the head its query heads i*H/shards.. read."""
    repeats = shards // config.num_kv_heads
    if repeats <= 1:
        return params
    layers = dict(params["layers"])
    for name in ("k_proj", "v_proj", "k_bias", "v_bias"):
        if name in layers:
            layers[name] = _repeat_weight_heads(layers[name], config.num_kv_heads, repeats)
    return {**params, "layers": layers}


def _repeat_weight_heads(weight: Any, heads: int, repeats: int) -> Any:
    if not isinstance(weight, QuantizedWeight):
        return _repeat_heads(weight, heads, repeats)
    offsets = weight.offsets
    return weight.replace(
        values=_repeat_heads(weight.values, heads, repeats),
        scales=_repeat_heads(weight.scales, heads, repeats),
        offsets=None if offsets is None else _repeat_heads(offsets, heads, repeats))


def _repeat_heads(x: Any, heads: int, repeats: int) -> np.ndarray:
    """x [L, heads * rows_per_head, ...] -> [L, heads * repeats * rows_per_head, ...]."""
    x = np.asarray(x)
    lead, rows, rest = x.shape[0], x.shape[1], x.shape[2:]
    grouped = x.reshape(lead, heads, rows // heads, *rest)
    return np.repeat(grouped, repeats, axis=1).reshape(lead, rows * repeats, *rest)


def param_shardings(params: Params, mesh: Mesh) -> Any:
    """A NamedSharding for every leaf of the (expanded) params."""
    shards = model_shards(mesh)
    layers = {name: _layer_sharding(name, weight, mesh, shards)
              for name, weight in params["layers"].items()}
    top = {name: _vocab_sharding(weight, mesh, shards) if name in ("embed", "lm_head")
           else _replicated(weight, mesh)
           for name, weight in params.items() if name != "layers"}
    return {**top, "layers": layers}


def _layer_sharding(name: str, weight: Any, mesh: Mesh, shards: int) -> Any:
    if name in COLUMN_PARALLEL:
        return _split_rows(weight, mesh, shards)
    if name in ROW_PARALLEL:
        return _split_columns(weight, mesh, shards)
    if name in BIASES:
        return _spec_if_divisible(weight, mesh, shards, axis=1)
    return _replicated(weight, mesh)


def _split_rows(weight: Any, mesh: Mesh, shards: int) -> Any:
    """Column parallel: a matrix [L, out, in] by output rows. A quantized weight's
    values, scales and offsets all have them at axis 1; its act_scale [L, in] does not."""
    if not isinstance(weight, QuantizedWeight):
        return _spec_if_divisible(weight, mesh, shards, axis=1)
    return jax.tree.map(lambda leaf: _spec_if_divisible(leaf, mesh, shards, axis=1)
                        if leaf.ndim == 3 else _replicated(leaf, mesh), weight)


def _split_columns(weight: Any, mesh: Mesh, shards: int) -> Any:
    """Row parallel: a matrix [L, out, in] by input columns. A quantized weight splits
    its values, act_scale and (several per row) groups of scales and offsets by
    column; one-group scales are replicated; uneven groups replicate the weight."""
    if not isinstance(weight, QuantizedWeight):
        return _spec_if_divisible(weight, mesh, shards, axis=2)
    groups = weight.num_groups
    if groups > 1 and groups % shards:
        return _replicated(weight, mesh)
    by_column = {"values": True, "act_scale": True, "scales": groups > 1, "offsets": groups > 1}
    return weight.replace(**{
        field: None if getattr(weight, field) is None else (
            _spec_if_divisible(getattr(weight, field), mesh, shards,
                               axis=getattr(weight, field).ndim - 1)
            if split else _replicated(getattr(weight, field), mesh))
        for field, split in by_column.items()})


def _vocab_sharding(weight: Any, mesh: Mesh, shards: int) -> Any:
    """Embedding / LM head [V, d]: vocabulary rows (every quantized leaf has them first)."""
    return jax.tree.map(lambda leaf: _spec_if_divisible(leaf, mesh, shards, axis=0)
                        if leaf.ndim >= 1 and leaf.shape[0] == _rows(weight) else
                        _replicated(leaf, mesh), weight)


def _rows(weight: Any) -> int:
    return (weight.values if isinstance(weight, QuantizedWeight) else weight).shape[0]


def _spec_if_divisible(leaf: Any, mesh: Mesh, shards: int, axis: int) -> NamedSharding:
    """Shard `axis` of leaf over 'model' when it divides evenly, else replicate."""
    if leaf.shape[axis] % shards:
        return _replicated(leaf, mesh)
    spec = [None] * leaf.ndim
    spec[axis] = MODEL
    return NamedSharding(mesh, P(*spec))


def _replicated(leaf: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), leaf)


def place_params(params: Params, config: ModelConfig, mesh: Mesh) -> Params:
    """The params of a model of `config`, KV heads expanded (`expand_kv_heads`) and
    split over the mesh; they then fit `sharded_config(config, shards)`."""
    shards = model_shards(mesh)
    check_tensor_parallel(config, shards)
    params = expand_kv_heads(params, config, shards)
    return jax.device_put(params, param_shardings(params, mesh))


def kv_pool_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """A K/V pool [L, rows, KV, hd] (or its scales [L, rows, KV]): rows by data rank,
    KV heads over 'model'."""
    spec = [None] * ndim
    spec[1], spec[2] = DATA, MODEL
    return NamedSharding(mesh, P(*spec))


def vocab_state_sharding(mesh: Mesh, vocab_size: int) -> NamedSharding:
    """Per-slot vocabulary state [ranks * slots, V] (penalty statistics): rows by data
    rank, vocabulary like the logits."""
    if vocab_size % model_shards(mesh):
        return NamedSharding(mesh, P(DATA, None))
    return NamedSharding(mesh, P(DATA, MODEL))
