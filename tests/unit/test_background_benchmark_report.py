"""The background benchmark reads the pack's own record of what a background compile ran beside
prompts from the finished compile's log line: the line's wording and the benchmark's reading
must stay in step."""
from __future__ import annotations

import pytest

from compile_core.run import compilers, pacing


@pytest.fixture(scope="module")
def bench(import_benchmark):
    return import_benchmark("background_benchmark")


def test_the_benchmark_reads_what_the_compile_ran_beside_prompts_from_the_packs_log(bench):
    beside = pacing.Beside()
    beside.cpu_s, beside.longest, beside.stretches = 0.52, 0.031, 41
    line = ("[INFO] [TorchCompileSpeed] background compile of WanAttentionBlock x8 finished in 40.1 s, "
            f"40 pause(s) for prompts (60.1 s){beside.text()}{compilers.held_text(14)}; the model's next "
            "call takes the compiled graphs")
    got = bench.beside_prompts(["[INFO] [TorchCompileSpeed] compiling in the background", line], 40, 1.2)
    assert bench.compilers_stopped(["[INFO] [TorchCompileSpeed] compiling in the background", line]) == 14
    assert got == {"cpu_s": 0.52, "stretches": 41, "longest_ms": 31, "per_run_ms": 13.0,
                   "longest_vs_eager_run": 0.0258}
    assert "31 ms in one (2.6 % of an eager run)" in bench._beside_text(got)


def test_a_compile_that_ran_beside_no_prompt_has_no_record(bench):
    line = ("[INFO] [TorchCompileSpeed] background compile of WanAttentionBlock x8 finished in 40.1 s; "
            "the model's next call takes the compiled graphs")
    assert bench.beside_prompts([line], 40, 1.2) is None and bench.compilers_stopped([line]) == 0
    assert "ran beside no prompt" in bench._beside_text(None)
