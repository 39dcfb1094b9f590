"""The llm stages' engines, read from their processes' batch boards into the worker's metrics:
requests in flight and the tokens they hold as gauges, tokens and engine restarts as counters
(each process posts its totals since it started; the meter counts what grew since its last
read)."""

from __future__ import annotations

from collections.abc import Iterable

from .. import metrics
from .processes import ProcState, StageProcess
from .stagepool import StagePool

_COUNTED = {
    "prompt_tokens": metrics.LLM_PROMPT_TOKENS,
    "output_tokens": metrics.LLM_OUTPUT_TOKENS,
    "restarts": metrics.LLM_ENGINE_RESTARTS,
}


class EngineMeter:
    def __init__(self) -> None:
        self._seen: dict[StageProcess, dict[str, int]] = {}
        """Each process's totals when last read."""

    def read(self, pools: Iterable[StagePool]) -> None:
        present: set[StageProcess] = set()
        for pool in pools:
            if pool.spec.llm is None:
                continue
            name = pool.spec.name
            in_flight = held = 0
            for p in pool:
                present.add(p)
                now = p.board.engine
                if p.state is not ProcState.DEAD:
                    in_flight += now["in_flight"]
                    held += now["held_tokens"]
                last = self._seen.get(p, {})
                for field, counter in _COUNTED.items():
                    grew = now[field] - last.get(field, 0)
                    if grew > 0:
                        counter.labels(name).inc(grew)
                self._seen[p] = now
            metrics.LLM_IN_FLIGHT.labels(name).set(in_flight)
            metrics.LLM_HELD_TOKENS.labels(name).set(held)
        for gone in self._seen.keys() - present:
            del self._seen[gone]
