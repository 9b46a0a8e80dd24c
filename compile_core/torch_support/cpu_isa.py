"""Torch's CPU ISA probe, settled ahead of a compile (``torch._inductor.cpu_vec_isa``, private)."""
from __future__ import annotations

import platform
import sys
import threading
from typing import Callable


def probe(each: Callable[[Callable[[], bool]], object] | None = None) -> bool:
    """Settle torch's per-process CPU ISA list, probing the candidate ISAs side by side.

    Torch checks each ISA this CPU lists (AVX2, AVX512, AVX512-VNNI, ...) by building a small
    C++ file with its flags and loading it in a child process, one ISA after another: about
    5 s of a cold CPU compile. Each candidate is a separate object with its own cached
    answer, so the checks run in parallel threads here, then torch's own list reuses the
    answers. With ``each`` (a background compile's ``pacing.lowered_step``) they run one at a
    time, each check through it: side by side they took 0.6 s of CPU inside one prompt, which
    ran 2x slower. Only x86-64 Linux (torch's probe elsewhere is a plain list); True when
    settled."""
    try:
        from torch._inductor import cpu_vec_isa as v
        if v.valid_vec_isa_list.cache_info().currsize:
            return True
        if sys.platform != "linux" or platform.machine() != "x86_64":
            return False
        flags = v.x86_isa_checker()
        candidates = [isa for isa in v.supported_vec_isa_list
                      if all(f in flags for f in str(isa).split())]
        if each is None:
            threads = [threading.Thread(target=bool, args=(isa,), daemon=True,
                                        name=f"torch-compile-speed-isa-{isa}") for isa in candidates]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for isa in candidates:
                each(isa.__bool__)
        v.valid_vec_isa_list()  # the answers are cached per ISA: no probe runs again
        return True
    except Exception:  # noqa: BLE001 - only an optimisation: torch probes on its own
        return False
