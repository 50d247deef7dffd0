"""What a torch.profiler trace says about one speculative step's phases: shared by ``spec_step_profile.py``
(ours) and ``vllm_spec_profile.py`` (vLLM's, run in vLLM's own environment), so it imports torch and the standard
library only.

Each phase is a ``record_function`` range the profiling script puts around the function that does it. For a
range, the operators directly inside it (not inside another operator) are the time in kernels; the rest of the
range's wall time is Python, the framework around the kernels and the host's waits. Linear layers
(``aten::linear`` / ``mkldnn::_linear_pointwise`` / ``aten::mm`` / ``aten::addmm`` and vLLM's own oneDNN matmul)
are counted apart, since at batch 1 a CPU forward is mostly streaming their weights.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

LINEAR_OPS = ("aten::linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "_C::onednn_mm", "onednn_mm")
PREFIX = "phase:"  # the record_function names of the phases
OUTER = "step"  # the phase a step is: the others count only inside it


class PhaseClock:
    """Wall seconds and calls per phase, from ``wrap``ped functions. The outer phase (``OUTER``, a decoding step)
    counts on its own; every other phase only while a step is open (a prefill's forwards are not a step's), and
    a phase nested in another counts in both."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.open: list[str] = []  # the phases open now, outermost first

    def wrap(self, owner: Any, attribute: str, phase: str | Callable[[list[str]], str | None]) -> None:
        """Time ``owner.attribute`` (a function or method) as ``phase``, under a ``record_function`` range too;
        ``phase`` may be a function of the open phases giving the name at call time (None: not timed)."""
        original = getattr(owner, attribute)
        clock = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            name = phase(clock.open) if callable(phase) else phase
            if name is None:
                return original(*args, **kwargs)
            counted = name == OUTER or OUTER in clock.open
            clock.open.append(name)
            start = time.perf_counter()
            with torch.profiler.record_function(PREFIX + name):
                try:
                    return original(*args, **kwargs)
                finally:
                    clock.open.pop()
                    if counted:
                        clock.seconds[name] += time.perf_counter() - start
                        clock.calls[name] += 1

        setattr(owner, attribute, timed)

    def reset(self) -> None:
        """Forget what was timed so far (the warm-up's steps)."""
        self.seconds.clear()
        self.calls.clear()

    def snapshot(self, steps: int) -> dict[str, dict[str, float]]:
        """Per phase: ms and calls per step, over ``steps`` steps (ValueError where there were none)."""
        if steps <= 0:
            raise ValueError(f"steps={steps}: no decoding step was timed (allowed is a count >= 1)")
        return {phase: {"ms_per_step": 1000 * self.seconds[phase] / steps, "calls_per_step": self.calls[phase] / steps}
                for phase in self.seconds}  # fmt: skip


@contextlib.contextmanager
def cpu_profile() -> Iterator[Any]:
    """torch.profiler over the CPU's operators while in the block."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield prof


def _is_op(event: Any) -> bool:
    return not event.name.startswith(PREFIX) and "::" in event.name


def _top_ops(event: Any) -> Iterator[Any]:
    """The operators under ``event`` that no other operator contains."""
    for child in event.cpu_children:
        if _is_op(child):
            yield child
        else:
            yield from _top_ops(child)


def _in_step(event: Any) -> bool:
    """Whether a profiler event lies inside a step's range (a prefill's does not)."""
    while event is not None:
        if event.name == PREFIX + OUTER:
            return True
        event = event.cpu_parent
    return False


def _linear_us(event: Any) -> float:
    """Microseconds of linear-layer operators in ``event`` and under it."""
    if any(event.name == name or event.name.endswith(name) for name in LINEAR_OPS):
        return event.cpu_time_total
    return sum(_linear_us(child) for child in event.cpu_children)


def phase_breakdown(prof: Any, steps: int) -> dict[str, dict[str, float]]:
    """Per phase range: ms per step of its wall time, of the operators in it, of its linear layers, and the rest
    (Python, framework and waits); the top operators by their time in it. ``steps``: the steps the trace holds."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in prof.events():
        if not event.name.startswith(PREFIX) or not _in_step(event):
            continue
        phase = event.name[len(PREFIX):]
        top = list(_top_ops(event))
        wall, in_ops = event.cpu_time_total, sum(op.cpu_time_total for op in top)
        totals[phase]["wall_ms"] += wall / 1000
        totals[phase]["ops_ms"] += in_ops / 1000
        totals[phase]["linear_ms"] += sum(_linear_us(op) for op in top) / 1000
        totals[phase]["calls"] += 1
        for op in top:
            ops[phase][op.name] += op.cpu_time_total / 1000
    out = {}
    for phase, values in totals.items():
        per_step = {key: value / steps for key, value in values.items()}
        per_step["outside_ops_ms"] = per_step["wall_ms"] - per_step["ops_ms"]
        per_step["top_ops_ms"] = dict(sorted(((name, ms / steps) for name, ms in ops[phase].items()), key=lambda kv: -kv[1])[:8])
        out[phase] = per_step
    return out


def markdown(rows: dict[str, dict[str, dict[str, float]]], order: list[str]) -> str:
    """A table per side: phase, ms per step (wall), in operators, in linear layers, outside operators."""
    lines = ["| side | phase | calls per step | wall ms/step | in operators | of which linear layers | outside operators |",
             "|---|---|---|---|---|---|---|"]
    for side, phases in rows.items():
        for phase in order + sorted(set(phases) - set(order)):
            if phase in phases:
                p = phases[phase]
                lines.append(f"| {side} | {phase} | {p['calls']:.2f} | {p['wall_ms']:.1f} | {p['ops_ms']:.1f} | "
                             f"{p['linear_ms']:.1f} | {p['outside_ops_ms']:.1f} |")
    return "\n".join(lines)


def write_result(path: Path, side: str, order: list[str], *, steps: int, timed: dict[str, dict[str, float]],
                 profile: dict[str, dict[str, Any]], **fields: Any) -> None:  # fmt: skip
    """Write one side's profile to ``path`` (its ``fields``, torch's version and threads, the steps, the timed and
    profiled phases) and print its timed phases and its profile's table."""
    result = {"side": side, **fields, "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": steps,
              "timed": timed, "profile": profile}  # fmt: skip
    path.write_text(json.dumps(result, indent=1))
    print(f"{side}: {steps} decode steps")
    for phase in order:
        if phase in timed:
            print(f"  {phase:15s} {timed[phase]['ms_per_step']:7.1f} ms/step, {timed[phase]['calls_per_step']:.2f} calls")
    print(markdown({f"{side} (profiled)": profile}, order))
