"""A follower process of a multi-host job: it serves nothing and runs what process 0 runs.

It builds the same engine as the leader (the runner's construction is itself
a series of collective calls: placing the params, agreeing on the KV pool size,
allocating it), connects to the leader's step broadcast and makes every call
the leader sends until told to stop. The calls run in a thread of their own so
that the main thread can notice a lost leader even while a call waits on the
devices of a process that is gone.
"""

from __future__ import annotations

import logging
import sys
import threading

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.parallel.multihost import LeaderLostError, Process, StepFollower, leave
from jaxinfer.weights import LoadedModel

logger = logging.getLogger(__name__)
POLL = 0.5  # seconds between checks that the leader is still there


def run_follower(model: LoadedModel, config: EngineConfig, process: Process,
                 worker_timeout: float) -> int:
    """Follow process 0 until it stops (returns 0) or is lost (returns 1)."""
    engine = LLMEngine(model, config)
    follower = StepFollower(process.broadcast_address, process.index, worker_timeout)
    host, port = process.broadcast_address
    print(f"jaxinfer serve: process {process.index} of {process.count} following "
          f"{host}:{port}", file=sys.stderr, flush=True)
    outcome: list[BaseException | int] = []
    thread = threading.Thread(target=_follow, args=(engine, follower, outcome),
                              name="jaxinfer-follow", daemon=True)
    thread.start()
    while thread.is_alive() and not follower.leader_lost.is_set():
        thread.join(POLL)
    if outcome and isinstance(outcome[0], int):
        leave()  # while the leader, which hosts JAX's service, waits for this hang-up
        follower.close()
        print(f"jaxinfer serve: process {process.index} stopped after {outcome[0]} calls",
              file=sys.stderr, flush=True)
        return 0
    follower.close()
    reason = outcome[0] if outcome else "its connection closed"
    print(f"jaxinfer serve: process {process.index} lost the leader: {reason}",
          file=sys.stderr, flush=True)
    return 1


def _follow(engine: LLMEngine, follower: StepFollower,
            outcome: list[BaseException | int]) -> None:
    try:
        outcome.append(engine.runner.follow(follower))
    except LeaderLostError as exc:
        outcome.append(exc)
    except Exception as exc:  # a failed call: report it and let the process end
        logger.exception("a mirrored call failed")
        outcome.append(exc)
        follower.leader_lost.set()
