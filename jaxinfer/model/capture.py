"""Capture named intermediates of the model from a jitted function (like Flax's `sow`).

The model marks points of its computation with `tap(name, x)`, which returns
`x` unchanged. `capture_intermediates(fn, names)` wraps any function that runs
the model so that it also returns the tapped values it asks for:

    import jax
    import jax.numpy as jnp
    from jaxinfer.model.capture import capture_intermediates
    from jaxinfer.model.transformer import dense_forward
    from jaxinfer.weights import load_model

    model = load_model("tests/data/tiny/llama")
    run = jax.jit(capture_intermediates(dense_forward, ["attn_in", "layer_out"]),
                  static_argnums=1)  # the config is static, as for dense_forward
    hidden, found = run(model.params, model.config, jnp.array([[1, 2, 3]]))
    found["layer_out"].shape  # (num_layers, 3, d_model): the residual stream, flat tokens

Taps inside the layer scan (`scan` below) come out stacked over layers, [L, ...],
because the scan body returns them as scan outputs. The points the decoder
marks are listed in `jaxinfer.model.transformer.TAPS`.

Capturing happens while JAX traces, never when the compiled program runs:

* Outside `capture_intermediates`, `tap` is the identity and `scan` is
  `jax.lax.scan`: uncaptured programs are exactly what they would be without
  taps, and a capture that asks for nothing adds no outputs.
* The names are part of the wrapped function, not a global read at run time,
  so `jax.jit` of a captured function caches its own program and a plain
  `jax.jit(forward)` never sees a capture.
* Call the model's plain functions inside `fn` and jit the captured function:
  a `jax.jit` inside `fn` traces (and caches) on its own. A requested name that
  no tap reached raises ValueError, so a missed capture is never silent.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jax

Carry = TypeVar("Carry")
Out = TypeVar("Out")


@dataclass
class _Scope:
    """What one traced function (or one scan body) asks for and what it tapped."""

    wanted: frozenset[str]
    values: dict[str, jax.Array] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)

    def record(self, name: str, value: Any) -> None:
        if name in self.seen:
            raise ValueError(f"intermediate {name!r} is tapped twice in one capture")
        self.seen.add(name)
        if name in self.wanted:
            self.values[name] = value


_state = threading.local()  # a trace runs on one thread; others trace uncaptured


def _current() -> _Scope | None:
    return getattr(_state, "scope", None)


@contextmanager
def _opened(scope: _Scope) -> Iterator[_Scope]:
    outer = _current()
    _state.scope = scope
    try:
        yield scope
    finally:
        _state.scope = outer


def tap(name: str, value: jax.Array) -> jax.Array:
    """Mark `value` as the intermediate `name`; returns it unchanged."""
    scope = _current()
    if scope is not None:
        scope.record(name, value)
    return value


def scan(
    body: Callable[[Carry, Any], tuple[Carry, Out]], init: Carry, xs: Any, *, unroll: int = 1
) -> tuple[Carry, Out]:
    """`jax.lax.scan` whose body's taps are recorded stacked over the iterations."""
    outer = _current()
    if outer is None:
        return jax.lax.scan(body, init, xs, unroll=unroll)
    inner = _Scope(outer.wanted)

    def tapped(carry: Carry, x: Any) -> tuple[Carry, tuple[Out, dict[str, jax.Array]]]:
        inner.values.clear()  # the body is traced once; start clean if traced again
        inner.seen.clear()
        with _opened(inner):
            carry, y = body(carry, x)
        return carry, (y, dict(inner.values))

    carry, (ys, stacked) = jax.lax.scan(tapped, init, xs, unroll=unroll)
    for name in sorted(inner.seen):
        outer.record(name, stacked.get(name))
    return carry, ys


def capture_intermediates(
    fn: Callable[..., Out], names: Iterable[str]
) -> Callable[..., tuple[Out, dict[str, jax.Array]]]:
    """`fn` that also returns {name: value} of the taps in `names` it reaches."""
    wanted = frozenset(names)

    @functools.wraps(fn)
    def captured(*args: Any, **kwargs: Any) -> tuple[Out, dict[str, jax.Array]]:
        with _opened(_Scope(wanted)) as scope:
            out = fn(*args, **kwargs)
        missing = sorted(wanted - scope.seen)
        if missing:
            raise ValueError(f"intermediates {missing} were not tapped; this function taps "
                             f"{sorted(scope.seen)}")
        return out, scope.values

    return captured
