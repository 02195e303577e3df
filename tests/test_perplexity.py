"""Perplexity: windows, the serving path against a dense hand computation, texts, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers import full_logits

from jaxinfer import LLM, evaluate
from jaxinfer.cli import main
from jaxinfer.errors import ConfigError
from jaxinfer.evaluate import (
    PerplexityResult,
    Window,
    load_text,
    perplexities,
    plan_windows,
    strip_markdown,
    text_token_ids,
)
from jaxinfer.weights import load_model

TINY = Path(__file__).parent / "data" / "tiny"
_full_logits = jax.jit(full_logits, static_argnums=1)


def dense_logprobs(model, ids: list[int], windows: list[tuple[int, int, int]]) -> np.ndarray:
    """log p of each scored token, by hand: full_logits over each window, no KV cache."""
    out = []
    for begin, score_from, end in windows:
        logits = _full_logits(model.params, model.config, np.array([ids[begin:end]], np.int32))
        logp = np.asarray(jax.nn.log_softmax(logits[0].astype(np.float32), axis=-1))  # [T, V]
        out += [logp[t - 1 - begin, ids[t]] for t in range(score_from, end)]
    return np.array(out, np.float64)


# --------------------------------------------------------------------------- windows


@pytest.mark.parametrize(("n", "max_len", "stride"),
                         [(40, 16, 8), (41, 16, 15), (16, 16, 8), (10, 16, None), (100, 7, 1),
                          (33, 8, 5)])
def test_every_token_after_the_first_is_scored_exactly_once(n, max_len, stride) -> None:
    windows = plan_windows(n, max_len, stride)
    scored = [t for w in windows for t in range(w.score_from, w.end)]
    assert scored == list(range(1, n))
    for w in windows:
        assert 0 <= w.begin < w.score_from < w.end <= n
        assert w.end - w.begin <= max_len


def test_windows_follow_the_sliding_recipe() -> None:
    assert plan_windows(40, 16, 8) == [Window(0, 1, 16), Window(8, 16, 24),
                                       Window(16, 24, 32), Window(24, 32, 40)]
    assert plan_windows(20, 16) == [Window(0, 1, 16), Window(8, 16, 20)]  # stride 8, short tail


@pytest.mark.parametrize(("n", "max_len", "stride"), [(10, 16, 16), (10, 16, 0), (1, 16, 8),
                                                     (10, 1, None)])
def test_bad_windows_are_refused(n, max_len, stride) -> None:
    with pytest.raises(ConfigError):
        plan_windows(n, max_len, stride)


def test_result_combines_token_weighted() -> None:
    a = PerplexityResult(np.log(np.array([0.5, 0.5])))
    b = PerplexityResult(np.log(np.array([0.25])))
    assert a.ppl == pytest.approx(2.0) and a.num_tokens == 2
    both = PerplexityResult.combine([a, b])
    assert both.nll == pytest.approx(2 * np.log(2) + np.log(4))
    assert both.ppl == pytest.approx(np.exp(both.nll / 3))


# --------------------------------------------------------------------------- serving path


def test_serving_path_equals_dense_full_logits() -> None:
    """Windowed scoring through LLM.generate(prompt_logprobs) matches a dense recompute;
    the tiny Gemma 3's 4-token sliding window is crossed many times."""
    model = load_model(TINY / "gemma3")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (40, 23)]
    llm = LLM(loaded=model, max_model_len=17, max_num_seqs=8, block_size=4)
    results = perplexities(llm, seqs, max_len=16, stride=8)
    windows = [[(0, 1, 16), (8, 16, 24), (16, 24, 32), (24, 32, 40)], [(0, 1, 16), (8, 16, 23)]]
    for ids, result, plan in zip(seqs, results, windows, strict=True):
        expected = dense_logprobs(model, ids, plan)
        assert result.num_tokens == len(ids) - 1
        np.testing.assert_allclose(result.logprobs, expected, atol=1e-4, rtol=0)
        assert result.nll == pytest.approx(-expected.sum(), rel=1e-5)


def test_int8_kv_cache_is_on_the_scoring_path() -> None:
    """An int8 KV cache changes the scores (so it is used), but only a little."""
    model = load_model(TINY / "llama")
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 24).tolist()
    settings = dict(max_model_len=17, max_num_seqs=2, block_size=4)
    dense = perplexities(LLM(loaded=model, **settings), [ids], max_len=16)[0]
    int8 = perplexities(LLM(loaded=model, kv_cache_dtype="int8", **settings), [ids], max_len=16)[0]
    assert not np.array_equal(dense.logprobs, int8.logprobs)
    assert int8.ppl == pytest.approx(dense.ppl, rel=0.02)


# --------------------------------------------------------------------------- texts


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from jaxinfer.tokenizer import Tokenizer
    from jaxinfer.weights import load_preset, resolve_source

    return Tokenizer.from_gguf(resolve_source(load_preset("gemma3-270m").source))


def test_strip_markdown_keeps_prose() -> None:
    text = ("<div><img src='x.png'></div>\n# Title\n\n[![badge](b.svg)](u)\n"
            "See the **[docs](https://x)** for `jit`.\n\n\n\n```python\ncode()\n```\nEnd.")
    assert strip_markdown(text) == "Title\n\nSee the docs for jit.\n\nEnd."


@pytest.mark.parametrize("name", ["jax", "sentencepiece", "tokenizers", "rich", "msgpack"])
def test_texts_are_deterministic_and_of_the_asked_length(name: str, gemma_tokenizer) -> None:
    ids = text_token_ids(gemma_tokenizer, name, 1024)
    assert len(ids) == 1024
    assert ids == text_token_ids(gemma_tokenizer, name, 1024)
    assert ids[0] == gemma_tokenizer.bos_id and gemma_tokenizer.bos_id not in ids[1:]
    assert "```" not in load_text(name) and "](" not in load_text(name)


def test_missing_text_package_is_a_clear_error(gemma_tokenizer) -> None:
    with pytest.raises(ConfigError, match="not installed"):
        text_token_ids(gemma_tokenizer, "no-such-package-xyz", 16)
    with pytest.raises(ConfigError, match="has only"):
        text_token_ids(gemma_tokenizer, "jax", 10**6)


# --------------------------------------------------------------------------- CLI


def test_cli_writes_the_table_and_json(tmp_path: Path, capsys) -> None:
    """A model without a tokenizer scores UTF-8 bytes (the tiny Llama has 256 ids)."""
    out = tmp_path / "ppl.json"
    argv = ["perplexity", "--model", str(TINY / "llama"), "--texts", "jax", "msgpack",
            "--num-tokens", "24", "--max-len", "16", "--stride", "8", "--kv-cache-dtype", "int8",
            "--block-size", "4", "--max-num-seqs", "8", "--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    (setting,) = json.loads(out.read_text())["settings"]
    assert (setting["name"], setting["kv_cache_dtype"], setting["ratio"]) == ("kv-int8", "int8", 1)
    assert setting["num_tokens"] == 2 * 23
    assert setting["ppl"] == pytest.approx(np.exp(setting["nll"] / 46))
    per_text = setting["per_text"]
    assert setting["nll"] == pytest.approx(per_text["jax"]["nll"] + per_text["msgpack"]["nll"])
    assert [line.split()[0] for line in table.splitlines()] == ["text", "jax", "msgpack",
                                                                "mean", "ratio"]


def test_all_settings_load_each_weight_format_once(monkeypatch) -> None:
    """The float weights serve both the baseline and the int8 KV cache; the rest load
    in turn; the texts are tokenized once."""
    loads, served = [], []

    def load(quantization: str) -> SimpleNamespace:
        loads.append(quantization)
        return SimpleNamespace(quantization=quantization, tokenizer=None, load_seconds=0.0,
                               config=SimpleNamespace(vocab_size=256), source="fake")

    def score(task, setting, loaded, engine_config) -> evaluate.SettingScores:
        served.append((setting.name, loaded.quantization, setting.kv_cache_dtype))
        assert [len(ids) for ids in task.sequences] == [10, 10]
        return evaluate.SettingScores(setting, [PerplexityResult(np.full(9, -1.0))] * 2, 0.0)

    monkeypatch.setattr(evaluate, "score_setting", score)
    rows, _ = evaluate.score_settings(evaluate.ALL_SETTINGS, load, None, texts=("jax", "rich"),
                                      num_tokens=10)
    assert loads == ["none", "int8", "w8a8", "int4", "int4-awq"]
    assert served == [("baseline", "none", "auto"), ("kv-int8", "none", "int8"),
                      ("int8", "int8", "auto"), ("w8a8", "w8a8", "auto"),
                      ("int4", "int4", "auto"), ("int4-awq", "int4-awq", "auto")]
    assert [r.mean.ppl for r in rows] == pytest.approx([np.e] * 6)


def test_cli_refuses_all_settings_with_a_quantization(capsys) -> None:
    assert main(["perplexity", "--model", str(TINY / "llama"), "--all-settings",
                 "--quantization", "int8"]) == 2
    assert "--all-settings" in capsys.readouterr().err
