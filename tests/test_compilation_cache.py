"""The persistent compilation cache: where it lives, and a second process reading it.

The end-to-end test runs `jaxinfer generate` on the tiny Llama (with the shared
test tokenizer) twice, each in
a fresh process, and reads JAX's own cache log (`JAX_LOG_COMPILES=1` logs
every persistent-cache hit): the first run writes entries and hits none, the
second hits the step program and writes nothing new. No timings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jaxinfer import compilation_cache

ROOT = Path(__file__).resolve().parent.parent
HIT = "Persistent compilation cache hit for"


def test_the_folder_follows_flag_then_environment_then_default(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(compilation_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache.cache_dir() == tmp_path / "xdg" / "jaxinfer" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compilation_cache.cache_dir() == Path.home() / ".cache" / "jaxinfer" / "xla"
    monkeypatch.setenv(compilation_cache.ENV_VAR, str(tmp_path / "env"))
    assert compilation_cache.cache_dir() == tmp_path / "env"
    assert compilation_cache.cache_dir(tmp_path / "flag") == tmp_path / "flag"
    assert compilation_cache.cache_dir("off") is None
    monkeypatch.setenv(compilation_cache.ENV_VAR, "off")
    assert compilation_cache.cache_dir() is None
    assert compilation_cache.enable() is None


def generate(model: Path, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "generate", "The capital of France is",
         "--model", str(model), "--max-tokens", "8", "--quiet", *flags],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_LOG_COMPILES": "1", **env})
    assert run.returncode == 0, run.stderr
    return run


def test_a_second_process_reads_the_steps_from_the_cache(
    tiny_llama_with_tokenizer: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "xla"
    first = generate(tiny_llama_with_tokenizer, "--compilation-cache-dir", str(folder),
                     env={compilation_cache.ENV_VAR: "off"})  # the flag wins
    entries = sorted(p.name for p in folder.iterdir())
    assert entries and HIT not in first.stderr
    assert any(name.startswith("jit__step") for name in entries)
    second = generate(tiny_llama_with_tokenizer, env={compilation_cache.ENV_VAR: str(folder)})
    assert f"{HIT} 'jit__step'" in second.stderr
    assert sorted(p.name for p in folder.iterdir()) == entries  # nothing compiled anew
    assert second.stdout == first.stdout


def test_off_leaves_the_cache_alone(tiny_llama_with_tokenizer, tmp_path) -> None:
    run = generate(tiny_llama_with_tokenizer, "--compilation-cache-dir", "off",
                   env={"XDG_CACHE_HOME": str(tmp_path)})
    assert HIT not in run.stderr and not (tmp_path / "jaxinfer").exists()
