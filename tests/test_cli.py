"""The `jaxinfer` command end to end on a tiny model: convert, then generate in a real
subprocess (exit code, JSON on stdout, timing on stderr), and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.cli import main
from jaxinfer.weights import load_model

PROMPT = "the cat sat on the mat"


def jaxinfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", *args],
                          capture_output=True, text=True, timeout=600)


def test_convert_then_generate_from_the_checkpoint(
    tmp_path: Path, tiny_llama_with_tokenizer: Path
) -> None:
    """The checkpoint generates what the source folder generates in process."""
    source = load_model(tiny_llama_with_tokenizer)
    want = LLM(loaded=source, max_model_len=64, max_num_seqs=1).generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    assert main(["convert", str(tiny_llama_with_tokenizer), str(tmp_path / "ckpt")]) == 0
    run = jaxinfer("generate", PROMPT, "--model", str(tmp_path / "ckpt"),
                   "--max-tokens", "8", "--json", "--max-model-len", "64")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["prompt_token_ids"] == source.tokenizer.encode(PROMPT)
    assert result["token_ids"] == want.token_ids and result["text"] == want.text
    assert result["finish_reason"] == "length"
    assert "first token" in run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--model", "/no/such/file.gguf"], "not a file or folder"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
        (["generate", "hi", "--model", "no-such-preset"], "unknown model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, capsys) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_corrupt_gguf_is_reported(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    assert main(["generate", "hi", "--model", str(bad)]) == 2
    assert "broken.gguf" in capsys.readouterr().err
