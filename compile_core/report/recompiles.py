"""Recompiles from dynamo's compilation records: the guard that failed, in plain language."""
from __future__ import annotations

import dataclasses
import re



# (substring of the failed guard, what usually causes it); first match wins.
RECOMPILE_HINTS: tuple[tuple[str, str], ...] = (
    ("weight_function", "LoRA/lowvram weight_function guard: ComfyUI partial loading attaches "
                        "per-LoRA weight functions; load the model fully or merge LoRAs"),
    ("GLOBAL_STATE changed", "TF32/grad-mode/autocast toggled between runs"),
    ("size mismatch", "a new latent size: use shape_policy auto or declare shapes"),
    ("stride mismatch", "a tensor's memory layout changed (a transposed, sliced or "
                        "channels-last input): shape_policy auto makes region inputs contiguous"),
    ("dtype mismatch", "model dtype changed"),
    ("device mismatch", "a tensor moved to another device between runs (offloading?)"),
    ("requires_grad mismatch", "grad mode or requires_grad on an input changed between runs"),
    ("___check_obj_id", "an object was replaced between runs"),
    ("ID_MATCH", "an object was replaced between runs"),
    ("___check_type_id", "an object of another type was passed (e.g. a different patch or "
                         "transformer_options entry)"),
    ("TYPE_MATCH", "an object of another type was passed (e.g. a different patch or "
                   "transformer_options entry)"),
    ("len(", "a list or dict changed length between runs (patches or transformer_options added)"),
    ("cache_size_limit", "the recompile limit was reached: that code now runs eagerly; raise "
                         "dynamo_cache_size_limit or remove the cause of the recompiles"),
    ("recompile_limit", "the recompile limit was reached: that code now runs eagerly; raise "
                        "dynamo_cache_size_limit or remove the cause of the recompiles"),
)
_NUMBER_GUARD = re.compile(r"==\s*-?\d+(\.\d+)?\s*(;|$)")


def recompile_hint(guard: str) -> str:
    """A plain-language cause for a failed guard ("" when the guard text is all we know)."""
    for needle, hint in RECOMPILE_HINTS:
        if needle in guard:
            return hint
    if _NUMBER_GUARD.search(guard.strip()):
        return ("a Python number this code reads (a token count, a size or a setting) differs "
                "between calls: one graph per value")
    return ""


_GUARD_LINE = re.compile(r"^\s*\d+/\d+:\s*(.*)$")


def parse_guard(reason: str) -> tuple[str, str]:
    """``(failed guard(s), source)`` from dynamo's recompile reason.

    Dynamo writes one ``"<frame>/<entry>: <guard>  # <code>  # <file:line in fn>"`` line per
    cache entry that failed, sometimes followed by a user stack trace."""
    lines = [ln for ln in reason.strip().splitlines() if ln.strip()]
    found = [m.group(1) for ln in lines if (m := _GUARD_LINE.match(ln))] or lines[:1]
    guards, source = [], ""
    for g in found:
        parts = [part.strip() for part in re.split(r"\s+#\s+", g.strip())]
        if parts[0] and parts[0] not in guards:
            guards.append(parts[0])
        if not source and len(parts) > 1:
            source = "  ".join(reversed(parts[1:]))  # "file:line in fn  code"
    return "; ".join(guards), source


@dataclasses.dataclass
class Recompile:
    frame: str
    guard: str
    hint: str          # plain-language cause ("" when the guard is all we know)
    seconds: float
    source: str = ""   # where the guarded value is used: "file:line in fn  code"
    during_diagnosis: bool = False


def recompiles_from(frames: list[dict], new_from: int | None = None) -> list[Recompile]:
    """The frames (``CompiledEntry.frames`` records) that were recompiles, with hints.
    ``new_from``: index of the first record added by the diagnosis itself."""
    out = []
    for i, f in enumerate(frames):
        reason = f.get("recompile_reason") or ""
        if not reason:
            continue
        guard, source = parse_guard(reason)
        out.append(Recompile(f.get("frame", "?"), guard, recompile_hint(guard),
                             float(f.get("seconds") or 0.0), source,
                             new_from is not None and i >= new_from))
    return out
