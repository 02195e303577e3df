"""The scheduler: budgets, chunking, FCFS admission, preemption (pure Python, no jax)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.scheduler import Scheduler, SequenceState, Status
from jaxinfer.errors import ConfigError


def make(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64) | config
    return Scheduler(EngineConfig(**settings).scheduler_config(),
                     BlockManager(num_blocks, block_size))


def run_step(scheduler: Scheduler, token: int = 7):
    """Pretend the device ran the plan: computed tokens, one sampled token per finisher."""
    plan = scheduler.schedule()
    for chunk in plan.prefills:
        scheduler.on_computed(chunk.seq, chunk.num_tokens)
        if chunk.completes:
            chunk.seq.output_ids.append(token)
    for seq in plan.decodes:
        scheduler.on_computed(seq, 1)
        seq.output_ids.append(token)
    return plan


def test_scheduler_and_block_manager_import_no_jax() -> None:
    import jaxinfer.engine.block_manager as bm
    import jaxinfer.engine.scheduler as sched

    for module in (sched, bm):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom)}
        assert imported, module.__name__
        assert not any(name.split(".")[0] in ("jax", "jaxlib", "numpy") for name in imported)
        assert all(name.split(".")[0] != "jaxinfer" or name.startswith("jaxinfer.engine.")
                   for name in imported)


def test_long_prompt_is_chunked_beside_decodes() -> None:
    scheduler = make(max_num_batched_tokens=16)
    short = SequenceState("a", list(range(5)), max_tokens=10)
    scheduler.add(short)
    run_step(scheduler)  # prefill of the short prompt
    long = SequenceState("b", list(range(100, 140)), max_tokens=10)
    scheduler.add(long)
    sizes = []
    for _ in range(3):
        plan = run_step(scheduler)
        assert short in plan.decodes  # the running stream keeps decoding every step
        sizes.append(sum(c.num_tokens for c in plan.prefills))
        assert plan.num_tokens <= 16
    assert sizes == [15, 15, 10] and long.num_computed == 40 and len(long.output_ids) == 1


def test_without_chunking_a_prompt_waits_for_room() -> None:
    scheduler = make(max_num_batched_tokens=64, enable_chunked_prefill=False)
    first, second = (SequenceState(r, list(range(40)), max_tokens=4) for r in "ab")
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [c.seq for c in plan.prefills] == [first]  # 40 + 40 > 64: second waits whole


def test_budget_validation_without_chunking() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=False)


def test_max_num_seqs_bounds_running() -> None:
    scheduler = make(max_num_seqs=2)
    seqs = [SequenceState(str(i), [1, 2, 3], max_tokens=4) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler)
    assert [s.status for s in seqs] == [Status.RUNNING] * 2 + [Status.WAITING] * 2
    scheduler.finish(seqs[0])
    run_step(scheduler)
    assert seqs[2].status is Status.RUNNING and seqs[3].status is Status.WAITING


def test_newest_is_preempted_when_blocks_run_out() -> None:
    scheduler = make(num_blocks=4, block_size=4)  # 16 tokens in all
    old = SequenceState("old", [1] * 7, max_tokens=20)
    new = SequenceState("new", [2] * 7, max_tokens=20)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prefilled: 8 tokens each after sampling, pool full
    run_step(scheduler)  # token 8 is the last of block 2: no new block yet
    plan = run_step(scheduler)  # old needs a third block for token 9: new is evicted
    assert plan.preempted == [new] and new.status is Status.WAITING
    assert new.num_computed == 0 and new.block_table == [] and scheduler.num_preemptions == 1
    assert scheduler.waiting[0] is new and old in plan.decodes


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    scheduler = make()
    prompt = list(range(10))
    first = SequenceState("a", prompt, max_tokens=2)
    scheduler.add(first)
    run_step(scheduler)
    second = SequenceState("b", [*prompt[:8], 99, 98], max_tokens=2)
    scheduler.add(second)
    plan = run_step(scheduler)
    (chunk,) = [c for c in plan.prefills if c.seq is second]
    assert chunk.start == 8 and chunk.num_tokens == 2 and second.num_cached == 8
    assert second.block_table[:2] == first.block_table[:2]


def test_sibling_waits_for_the_first_samples_prompt() -> None:
    scheduler = make()
    first = SequenceState("r", list(range(12)), max_tokens=3)
    sibling = SequenceState("r", list(range(12)), max_tokens=3, sample_index=1, wait_for=first)
    scheduler.add(first)
    scheduler.add(sibling)
    plan = run_step(scheduler)
    assert [c.seq for c in plan.prefills] == [first]
    plan = run_step(scheduler)
    (chunk,) = [c for c in plan.prefills if c.seq is sibling]
    assert chunk.start == 8  # two full blocks reused, the rest computed


def test_finish_frees_blocks_and_slot() -> None:
    scheduler = make()
    seq = SequenceState("a", list(range(9)), max_tokens=3)
    scheduler.add(seq)
    run_step(scheduler)
    used = scheduler.blocks.num_used
    scheduler.finish(seq)
    assert used == 3 and scheduler.blocks.num_used == 0 and seq.slot == -1
    assert not scheduler.has_unfinished()
