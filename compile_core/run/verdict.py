"""The defaults never lose to eager: where a model's compiled blocks are not faster than its
eager ones on this card, the model runs eagerly.

Once a model's compiled graphs have run once (its compile and first compiled call are behind
it) and no compile is running, its next model calls take turns, a pair at a time: one eagerly,
one on the compiled graphs (the order flips every pair, so a drift hits both), each timed to its
end (on CUDA between synchronizes). A pair whose compiled call compiled or loaded anything does
not count. After ``PAIRS`` pairs the verdict is the median of compiled/eager: below 1.0 the model
stays compiled; at 1.0 or more every model sharing its compiled entry runs eagerly from then on,
said once with the ratio. The timed calls are the run's own steps (nothing runs twice), and an
eager step gives the output the compiled one would.

The verdict is kept per card and torch in the persistent cache entry (``verdict.json``) and in
the fleet's store, so a restarted server or another worker with the same card neither measures
again nor, where it says eager, compiles. Deleting ``verdict.json`` measures again.

Made on CUDA only, where the pack's users run (``DEVICES``); a CPU model keeps its compile. The
tests add ``"cpu"`` to stand in for a GPU.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Callable

import torch
from torch import nn

from . import background
from .state import ModelState
from ..cache import persist
from ..report import log

PAIRS = 3
DEVICES = ["cuda"]
FILE = "verdict.json"


@dataclasses.dataclass
class Trial:
    """One compiled entry's measurement, kept with the entry (models sharing it share it)."""
    recalled: bool = False  # the saved verdict was looked up
    decided: bool = False
    half: dict = dataclasses.field(default_factory=dict)  # the pair so far: kind -> seconds
    ratios: list = dataclasses.field(default_factory=list)  # compiled / eager, one per pair


def card(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class Judge:
    """The route that times pairs of model calls until the verdict is in (see above)."""

    def __init__(self, state: ModelState, background_route, foreground):
        self.state, self.background, self.foreground = state, background_route, foreground

    def run(self, diffusion_model: nn.Module, call: Callable[[], object], device: torch.device) -> tuple | None:
        e = self.state.entry
        if device.type not in DEVICES or e.failed or e.slower:
            return None
        t = e.trial = e.trial or Trial()
        if not t.recalled:
            t.recalled = True
            if recall(self.state, device, t):
                return (call(),) if e.slower else None
        if (t.decided or not self.state.ran or background.busy() or self.background.job is not None
                or self.background.foreground_depth):
            return None  # (a job of this model's is the background route's to swap; inside
            # ``CompiledModel.foreground()`` the caller compiles or measures on its own terms)
        kind = ("eager", "compiled")[(len(t.ratios) + len(t.half)) % 2]
        graphs = e.graphs
        run = call if kind == "eager" else (lambda: self.foreground.run(diffusion_model, call, device)[0])
        seconds, out = _timed(run, device)
        if e.graphs != graphs or e.failed or self.background.job is not None:
            t.half.clear()  # it compiled, fell back or ran regions eagerly for a compile: not a step time
            return (out,)
        t.half[kind] = seconds
        if len(t.half) == 2:
            t.ratios.append(t.half["compiled"] / max(t.half["eager"], 1e-9))
            t.half.clear()
        if len(t.ratios) >= PAIRS:
            decide(self.state, device, t)
        return (out,)


def _timed(call: Callable[[], object], device: torch.device) -> tuple[float, object]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d: None)
    sync(device)
    start = time.perf_counter()
    out = call()
    sync(device)
    return time.perf_counter() - start, out


def decide(state: ModelState, device: torch.device, t: Trial) -> None:
    ratio = statistics.median(t.ratios)
    t.decided = True
    record = {"card": card(device), "torch": torch.__version__, "ratio": round(ratio, 4),
              "pairs": [round(r, 4) for r in t.ratios], "eager": ratio >= 1.0, "saved": time.time()}
    _save(state, device, record)
    if not record["eager"]:
        log.info("%s stays compiled: on %s its compiled steps take %.3fx the time of its eager "
                 "ones (median of %d pairs of its own steps)", state.description, record["card"],
                 ratio, len(t.ratios))
        return
    _demote(state, record)
    log.warning("%s runs eagerly from now on: on %s its compiled steps took %.3fx the time of its "
                "eager ones (median of %d pairs of its own steps), so compiling does not pay here; "
                "the output is the same. Kept with its saved work: a restart runs it eagerly "
                "without compiling", state.description, record["card"], ratio, len(t.ratios))


def _demote(state: ModelState, record: dict) -> None:
    state.entry.slower = (f"compiled steps took {record['ratio']:.2f}x eager's on {record['card']}, "
                          "so it runs eagerly")
    state.changed = True


def recall(state: ModelState, device: torch.device, t: Trial) -> bool:
    """The verdict saved for this entry, card and torch (persistent cache, else the fleet), applied."""
    record = _read(state, device)
    if record is None:
        return False
    t.decided = True
    if record.get("eager"):
        _demote(state, record)
        log.info("%s runs eagerly without compiling: on %s its compiled steps were measured at "
                 "%.3fx eager's (kept in %s; delete it to measure again)", state.description,
                 record["card"], record.get("ratio", 1.0), FILE)
    return True


def _valid(record, device: torch.device) -> bool:
    return (isinstance(record, dict) and record.get("card") == card(device)
            and record.get("torch") == torch.__version__ and isinstance(record.get("eager"), bool))


def _read(state: ModelState, device: torch.device) -> dict | None:
    local, key = state.persistent, card(device)
    if local is not None:
        path = local.entry_dir(state.fingerprint) / FILE
        try:
            record = json.loads(path.read_text()).get(key) if path.exists() else None
        except (OSError, ValueError, AttributeError) as exc:
            log.info_once(f"verdict-unreadable:{path}", "%s could not be read (%s: %s): measuring "
                          "compiled against eager again", path, type(exc).__name__, exc)
            record = None
        if _valid(record, device):
            return record
    if state.fleet is not None:
        record = state.fleet.fetch_note(state.fingerprint, device, "verdict")
        if _valid(record, device):
            return record
    return None


def _save(state: ModelState, device: torch.device, record: dict) -> None:
    local = state.persistent
    if local is not None:
        path = local.entry_dir(state.fingerprint) / FILE
        try:
            kept = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            kept = {}
        kept = {**(kept if isinstance(kept, dict) else {}), record["card"]: record}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            persist.write_atomic(path, json.dumps(kept, indent=1))
        except OSError as exc:
            persist.io_failed(local.root, f"save {FILE}", exc)
    if state.fleet is not None:
        state.fleet.publish_note(state.fingerprint, device, "verdict", record)
