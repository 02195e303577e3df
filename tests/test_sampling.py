"""Sampler tests: parameter validation, exact filters, seeds, penalties, log-probs,
no recompilation, stop strings. Small vocabularies except one V=262,144 test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import ConfigError
from jaxinfer.sampling import (
    MAX_LOGPROBS,
    MAX_STOP,
    SamplingArrays,
    SamplingParams,
    apply_penalties,
    find_stop_string,
    make_sampling_arrays,
    sample,
    seed_to_key_data,
    update_output_counts,
)

V = 64
DRAWS = 4000
sample_jit = jax.jit(sample, static_argnames="num_top_logprobs")
penalties_jit = jax.jit(apply_penalties)
counts_jit = jax.jit(update_output_counts)


def _logits(seed: int, scale: float = 1.5) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=V) * scale).astype(np.float32)  # [V]


def _run(logits: np.ndarray, arrays: SamplingArrays, k: int = 0, prompt_mask=None, counts=None):
    batch, vocab = logits.shape
    prompt_mask = np.zeros((batch, vocab), bool) if prompt_mask is None else prompt_mask
    counts = np.zeros((batch, vocab), np.int32) if counts is None else counts
    return sample_jit(logits, arrays, prompt_mask, counts, num_top_logprobs=k)


def _draw(logits: np.ndarray, params: SamplingParams, steps=None) -> np.ndarray:
    """DRAWS tokens [DRAWS] for one logits row [V]: one row per seed (or per step)."""
    seeds = list(range(DRAWS)) if steps is None else [7] * DRAWS
    steps = [0] * DRAWS if steps is None else steps
    arrays = make_sampling_arrays([params] * DRAWS, seeds, steps, DRAWS)
    return np.asarray(_run(np.tile(logits, (DRAWS, 1)), arrays).tokens)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _reference(logits: np.ndarray, t: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filtered, renormalized distribution [V], computed independently in float64."""
    p = _softmax(logits.astype(np.float64) / t)
    keep = p >= min_p * p.max()
    if min_p > 0:
        assert np.min(np.abs(p / p.max() - min_p)) > 1e-3, "fixture too close to the min_p edge"
    if top_k > 0:
        keep &= p >= np.sort(np.where(keep, p, -1))[::-1][top_k - 1]
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    order = np.argsort(-q)
    mass_before = np.cumsum(q[order]) - q[order]
    if top_p < 1:
        assert np.min(np.abs(np.cumsum(q[order]) - top_p)) > 1e-3, "fixture too close to top_p"
    keep_sorted = mass_before < top_p
    keep = np.zeros(V, bool)
    keep[order[keep_sorted]] = True
    q = np.where(keep, q, 0)
    return q / q.sum()


# --------------------------------------------------------------------------- params


BAD_PARAMS = [
    ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -0.1),
    ("temperature", float("inf")), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.01), ("top_p", float("nan")), ("top_k", -2), ("top_k", 2.0), ("min_p", -0.01),
    ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("n", 0),
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1), ("prompt_logprobs", MAX_LOGPROBS + 1),
    ("seed", -1), ("seed", 2**63), ("stop", [""]), ("stop", ["s"] * (MAX_STOP + 1)),
    ("stop", 5), ("stop_token_ids", [-1]), ("ignore_eos", "yes"), ("skip_special_tokens", 1),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS)
def test_bad_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field} must be" in str(info.value)
    shown = repr(tuple(value) if isinstance(value, list) else value)[:20]
    assert shown in str(info.value)


def test_messages_state_the_allowed_range() -> None:
    with pytest.raises(ConfigError, match=r"top_p must be in \(0, 1\], got 0\.0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match=r"presence_penalty must be in \[-2, 2\], got 3"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ConfigError, match=r"logprobs must be None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)


def test_edge_values_are_accepted_and_lists_become_tuples() -> None:
    p = SamplingParams(
        top_p=1.0, min_p=1.0, top_k=-1, presence_penalty=-2, frequency_penalty=2, logprobs=0,
        prompt_logprobs=MAX_LOGPROBS, seed=2**63 - 1, stop=["a"] * MAX_STOP, stop_token_ids=[1, 2],
    )
    assert p.stop == ("a",) * MAX_STOP and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop="END").stop == ("END",)
    assert hash(p) == hash(SamplingParams(**{f: getattr(p, f) for f in p.__dataclass_fields__}))
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy


# --------------------------------------------------------------------------- arrays


def test_make_sampling_arrays_pads_with_neutral_greedy_rows() -> None:
    params = [SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.1,
                             repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-1),
              SamplingParams(temperature=0, top_k=5, top_p=0.5, repetition_penalty=1.5)]
    a = make_sampling_arrays(params, [3, 2**40 + 9], [4, 0], batch_size=4)
    np.testing.assert_allclose(a.temperature, [0.7, 0, 0, 0])
    np.testing.assert_array_equal(a.top_k, [0, 0, 0, 0])  # -1 -> 0; greedy rows neutral
    np.testing.assert_allclose(a.top_p, [0.9, 1, 1, 1])
    np.testing.assert_allclose(a.min_p, [0.1, 0, 0, 0])
    np.testing.assert_allclose(a.repetition_penalty, [1.2, 1.5, 1, 1])
    np.testing.assert_allclose(a.presence_penalty, [0.5, 0, 0, 0])
    np.testing.assert_allclose(a.frequency_penalty, [-1, 0, 0, 0])
    np.testing.assert_array_equal(a.key, [[0, 3], [256, 9], [0, 0], [0, 0]])
    np.testing.assert_array_equal(a.step, [4, 0, 0, 0])
    assert [x.dtype for x in a] == [np.float32, np.int32] + [np.float32] * 5 + [np.uint32, np.int32]


@pytest.mark.parametrize("seed", [0, 5, 2**32 - 1])
def test_seed_key_data_matches_jax(seed: int) -> None:
    expected = np.asarray(jax.random.key_data(jax.random.key(seed)))
    np.testing.assert_array_equal(seed_to_key_data(seed), expected)


def test_make_sampling_arrays_rejects_bad_batches() -> None:
    p = SamplingParams()
    with pytest.raises(ConfigError, match="seeds and steps"):
        make_sampling_arrays([p, p], [1], [0, 0], 2)
    with pytest.raises(ConfigError, match="batch_size must be"):
        make_sampling_arrays([p, p], [1, 2], [0, 0], 1)
    with pytest.raises(ConfigError, match="steps must be"):
        make_sampling_arrays([p], [1], [-1], 1)


def test_output_counts() -> None:
    counts = np.zeros((3, 8), np.int32)
    for _ in range(2):
        counts = counts_jit(counts, jnp.array([1, 2, 1]), jnp.array([True, True, False]))
    expected = np.zeros((3, 8), np.int32)
    expected[0, 1] = expected[1, 2] = 2
    np.testing.assert_array_equal(counts, expected)


# --------------------------------------------------------------------------- greedy and limits


def test_greedy_is_argmax_of_penalized_logits() -> None:
    logits = np.stack([_logits(i) for i in range(8)])  # [8, V]
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0, 1e-6] * 4)]
    out = _run(logits, make_sampling_arrays(params, range(8), range(8), 8))
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    logits[:, [3, 9]] = logits.max() + 1  # ties go to the lowest index, as np.argmax
    np.testing.assert_array_equal(
        _run(logits, make_sampling_arrays(params, range(8), range(8), 8)).tokens, [3] * 8
    )
    # A repetition penalty on the winner hands greedy to the runner-up.
    mask = np.zeros((8, V), bool)
    mask[0, logits[0].argmax()] = True
    p = [SamplingParams(temperature=0, repetition_penalty=100.0)] * 8
    out = _run(logits, make_sampling_arrays(p, [0] * 8, [0] * 8, 8), prompt_mask=mask)
    assert out.tokens[0] == np.argsort(-logits[0])[1]
    np.testing.assert_array_equal(out.tokens[1:], logits[1:].argmax(-1))


def test_temperature_to_zero_approaches_argmax() -> None:
    logits = np.random.default_rng(1).permutation(np.arange(V) * 0.05).astype(np.float32)
    fractions = [np.mean(_draw(logits, SamplingParams(temperature=t)) == logits.argmax())
                 for t in (1.0, 0.3, 0.1, 1e-3)]
    assert fractions[0] < fractions[1] < fractions[2] < fractions[3] == 1.0


def test_top_k_one_is_greedy() -> None:
    logits = _logits(2)
    tokens = _draw(logits, SamplingParams(temperature=1.5, top_k=1))
    assert np.all(tokens == logits.argmax())


# --------------------------------------------------------------------------- distributions

CASES = {
    "temperature": dict(temperature=1.3),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "all": dict(temperature=0.7, top_k=10, top_p=0.8, min_p=0.02),
}


@pytest.mark.parametrize("case", list(CASES))
def test_filtered_distribution_matches_reference(case: str) -> None:
    kw = CASES[case]
    logits = _logits(3)
    expected = _reference(logits, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0),
                          kw.get("min_p", 0.0))  # [V]
    tokens = _draw(logits, SamplingParams(**kw))
    observed = np.bincount(tokens, minlength=V)  # [V]
    assert set(np.flatnonzero(observed)) <= set(np.flatnonzero(expected)), "outside support"
    big = expected * DRAWS >= 5  # chi-square over bins with >= 5 expected, the rest pooled
    exp_bins = np.append(expected[big] * DRAWS, expected[~big].sum() * DRAWS)
    obs_bins = np.append(observed[big], observed[~big].sum())
    exp_bins, obs_bins = exp_bins[exp_bins > 0], obs_bins[exp_bins > 0]
    chi2 = np.sum((obs_bins - exp_bins) ** 2 / exp_bins)
    dof = max(len(exp_bins) - 1, 1)
    assert chi2 < dof + 6 * np.sqrt(2 * dof), f"chi2 {chi2:.1f} with {dof} dof"
    if case != "temperature":
        assert expected.astype(bool).sum() < V  # the filter did remove tokens


def test_support_of_each_filter_is_exact() -> None:
    logits = _logits(4)
    p = _softmax(logits.astype(np.float64))
    order = np.argsort(-p)
    topk = set(_draw(logits, SamplingParams(top_k=3)).tolist())
    assert topk == set(order[:3].tolist())
    floor = set(_draw(logits, SamplingParams(min_p=0.5)).tolist())
    assert floor == set(np.flatnonzero(p >= 0.5 * p.max()).tolist())
    n_keep = int(np.searchsorted(np.cumsum(p[order]), 0.5) + 1)  # smallest set with mass >= 0.5
    nucleus = set(_draw(logits, SamplingParams(top_p=0.5)).tolist())
    assert nucleus == set(order[:n_keep].tolist())


# --------------------------------------------------------------------------- seeds


def test_same_seed_same_tokens_and_steps_differ() -> None:
    logits = np.zeros(V, np.float32)
    by_step = _draw(logits, SamplingParams(), steps=list(range(DRAWS)))  # one seed, many steps
    assert len(set(by_step.tolist())) == V
    same_step = _draw(logits, SamplingParams(), steps=[11] * DRAWS)  # one seed, one step
    assert len(set(same_step.tolist())) == 1
    np.testing.assert_array_equal(by_step, _draw(logits, SamplingParams(), list(range(DRAWS))))


def test_a_row_samples_the_same_alone_or_in_any_batch() -> None:
    others = [SamplingParams(temperature=0), SamplingParams(top_k=3),
              SamplingParams(top_p=0.5, temperature=2.0), SamplingParams(min_p=0.3),
              SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0),
              SamplingParams(top_k=2, top_p=0.9), SamplingParams(presence_penalty=-2)]
    batch_logits = np.stack([_logits(10 + i) for i in range(8)])  # [8, V]
    for row in (SamplingParams(temperature=0.8), SamplingParams(top_p=0.9, top_k=20)):
        tokens = set()
        for seed in range(20):
            alone = _run(batch_logits[5:6], make_sampling_arrays([row], [seed], [3], 1))
            crowd = [*others[:5], row, *others[5:]]
            seeds = [seed if i == 5 else 1000 + i for i in range(8)]
            mixed = _run(batch_logits, make_sampling_arrays(crowd, seeds, [3] * 8, 8),
                         counts=np.ones((8, V), np.int32) * (np.arange(8)[:, None] != 5))
            assert int(alone.tokens[0]) == int(mixed.tokens[5])
            np.testing.assert_allclose(alone.logprobs[0], mixed.logprobs[5], rtol=1e-6)
            tokens.add(int(alone.tokens[0]))
        assert len(tokens) > 3  # the seeds really vary the draw


# --------------------------------------------------------------------------- penalties, logprobs


def test_penalties_follow_the_formula() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 3  # both signs
    prompt = rng.random((3, V)) < 0.3
    counts = rng.integers(0, 3, size=(3, V)).astype(np.int32) * (rng.random((3, V)) < 0.3)
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2),
              SamplingParams()]
    arrays = make_sampling_arrays(params, [0, 0, 0], [0, 0, 0], 3)
    got = np.asarray(penalties_jit(logits, arrays, prompt, counts))
    expected = logits.astype(np.float64).copy()
    for b, p in enumerate(params):
        for v in range(V):
            if prompt[b, v] or counts[b, v] > 0:
                r = p.repetition_penalty
                expected[b, v] = expected[b, v] / r if expected[b, v] > 0 else expected[b, v] * r
            expected[b, v] -= p.frequency_penalty * counts[b, v]
            expected[b, v] -= p.presence_penalty * (counts[b, v] > 0)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[2], logits[2])  # neutral row untouched
    assert np.abs(got[:2] - logits[:2]).max() > 0.5


def test_logprobs_are_raw_log_softmax_and_tops_sorted() -> None:
    logits = np.stack([_logits(20 + i) for i in range(8)])  # [8, V]
    params = [SamplingParams(temperature=0.5, repetition_penalty=2.0, top_k=4)] * 8
    prompt = np.ones((8, V), bool)  # penalties move the logits; logprobs must not see that
    out = _run(logits, make_sampling_arrays(params, range(8), [0] * 8, 8), k=5,
               prompt_mask=prompt)
    logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))  # [8, V]
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, logp[np.arange(8), tokens], rtol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, axis=-1)[:, :5])
    np.testing.assert_allclose(out.top_logprobs, np.sort(logp, -1)[:, ::-1][:, :5], rtol=1e-5)
    assert np.all(np.diff(np.asarray(out.top_logprobs), axis=-1) <= 0)
    out0 = _run(logits, make_sampling_arrays(params, range(8), [0] * 8, 8), k=0)
    assert out0.top_ids.shape == (8, 0) and out0.top_logprobs.shape == (8, 0)


# --------------------------------------------------------------------------- compilation


def test_no_setting_value_recompiles() -> None:
    # jit shares its cache between wrappers of one function: wrap it afresh.
    fn = jax.jit(lambda *args, **kw: sample(*args, **kw), static_argnames="num_top_logprobs")
    logits = np.stack([_logits(30 + i) for i in range(8)])
    mask, counts = np.zeros((8, V), bool), np.zeros((8, V), np.int32)
    settings = [dict(temperature=0), dict(temperature=0.5), dict(top_k=7), dict(top_p=0.3),
                dict(min_p=0.2, temperature=3.0), dict(repetition_penalty=1.7),
                dict(presence_penalty=1, frequency_penalty=-1), dict(top_k=-1, seed=9)]
    results = []
    for i, kw in enumerate(settings):
        arrays = make_sampling_arrays([SamplingParams(**kw)] * 8, [i] * 8, [i] * 8, 8)
        results.append(np.asarray(fn(logits, arrays, mask, counts, num_top_logprobs=2).tokens))
    assert fn._cache_size() == 1
    assert len({r.tobytes() for r in results}) > 2  # the settings did change the output
    fn(logits, arrays, mask, counts, num_top_logprobs=3)
    assert fn._cache_size() == 2  # the counter does see a real recompilation


# --------------------------------------------------------------------------- full vocabulary


def test_full_vocabulary_cond_paths() -> None:
    vocab, batch = 262_144, 8
    row = np.full(vocab, -20.0, np.float32)
    row[[1000, 5000, 200_000]] = [5.0, 4.5, 4.0]  # probs ~ .51, .31, .19
    logits = np.tile(row, (batch, 1))  # [8, V]
    mask, counts = np.zeros((batch, vocab), bool), np.zeros((batch, vocab), np.int32)

    def tokens(params: list[SamplingParams]) -> np.ndarray:
        arrays = make_sampling_arrays(params, range(batch), [2] * batch, batch)
        return np.asarray(sample_jit(logits, arrays, mask, counts, num_top_logprobs=0).tokens)

    assert np.all(tokens([SamplingParams(temperature=0)] * batch) == 1000)
    free = tokens([SamplingParams()] * batch)  # random path, no filter path
    assert set(free.tolist()) <= {1000, 5000, 200_000} and len(set(free.tolist())) > 1
    filtered = [SamplingParams(), SamplingParams(top_k=1), SamplingParams(top_k=2)]
    filtered += [SamplingParams(top_p=0.7)] * 4 + [SamplingParams(temperature=0)]
    got = tokens(filtered)  # filter path for the whole batch
    assert got[0] == free[0]  # an unfiltered row is unchanged by its neighbours' filters
    assert got[1] == 1000 and got[7] == 1000
    assert set(got[2:7].tolist()) <= {1000, 5000}


# --------------------------------------------------------------------------- stop strings


def test_find_stop_string_basics() -> None:
    assert find_stop_string("hello STOP world", ["STOP"], 0) == (6, "STOP")
    assert find_stop_string("abc xyz def", ["def", "xyz"], 0) == (4, "xyz")
    assert find_stop_string("abc xyz def", ["zz"], 0) is None
    assert find_stop_string("abc", [], 0) is None
    assert find_stop_string("STOP then more text", ["STOP"], 15) is None  # already checked


def test_find_stop_string_split_across_deltas() -> None:
    text, found = "", []
    for delta in ["Hello S", "T", "OP and", " more"]:
        text += delta
        found.append(find_stop_string(text, ["\n\n", "STOP"], len(text) - len(delta)))
    assert found == [None, None, (6, "STOP"), None]
