"""What dynamo and inductor record about the compiles they ran (private counters and records):
graphs, graph breaks, per-frame compile records, FX-graph cache hits."""
from __future__ import annotations


def compilation_metrics() -> list:
    """Dynamo's compilation records, one per compiled frame (it keeps the last 64)."""
    from torch._dynamo.utils import get_compilation_metrics
    return list(get_compilation_metrics())


def fx_cache_counts() -> tuple[int, int]:
    """(FX-graph cache hits, misses) so far in this process."""
    from torch._dynamo.utils import counters
    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])


def graph_count() -> int:
    """Graphs dynamo has compiled in this process (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def graph_break_count() -> int:
    """Graph breaks dynamo has met in this process (its ``graph_break`` counters)."""
    from torch._dynamo.utils import counters
    return int(sum(counters["graph_break"].values()))


def graph_breaks_by_reason() -> dict[str, int]:
    """Dynamo's graph-break counts by reason, read from a copy: ``dict()`` copies the counter
    without letting another thread run, while a background compile's trace may add a reason
    between two steps of a loop over the counter itself."""
    from torch._dynamo.utils import counters
    return {str(k): int(v) for k, v in dict(counters["graph_break"]).items()}
