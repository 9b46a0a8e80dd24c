"""Model zoo: every diffusion model class of the host ComfyUI, tiny and random, eager vs compiled.

    .venv/bin/python tests/host/regions/model_zoo.py [--cases a,b] [--backend inductor|aot_eager]
                                                    [--json out.json] [--md out.md]

(``scripts/model_zoo.sh`` runs it for the committed table.) For each case of ``zoo_cases.CASES``
it builds the real ComfyUI class with a tiny config on CPU with random weights, plans its regions
(``compile_core.plan.regions.plan_regions``), and runs the model eagerly and through
``compile_core.run.engine.prepare(...).run(...)`` at a first latent size and then at a second one.
Per case: the blocks found, dynamo graphs of the first run, new graphs at the second size,
relative L2 to eager at both sizes and a status: ``regional``, ``whole`` (+ why),
``fallback`` (+ the compile error) or ``cpu`` (the model cannot run eagerly here, + why).
One JSON object per case on stdout; ``--json`` / ``--md`` write the whole table.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build_tiny_models as tiny  # noqa: E402 - also resolves the host (tiny.COMFY_DIR)

SIZES = ((12, 20), (16, 24))  # latent h x w: the first run, then a new size (token counts 60, 96)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _rel_l2(out, ref) -> float:
    import torch
    out, ref = _flat(out), _flat(ref)
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-12))


def _flat(out):
    """All of a model's output as one float vector (LTX-2 returns [video, audio])."""
    import torch
    parts = out if isinstance(out, (tuple, list)) else [out]
    return torch.cat([p.float().flatten() for p in parts if isinstance(p, torch.Tensor)])


def _regions_called(model, plan, call) -> int:
    """How many planned regions the forward enters through ``__call__`` (where compile attaches)."""
    seen = set()
    hooks = [m.register_forward_pre_hook(lambda mod, a, p=p: seen.add(p))
             for p, m in zip(plan.paths, plan.modules(model))]
    try:
        call()
    finally:
        for h in hooks:
            h.remove()
    return len(seen)


def _status(plan, failed: str, logs: list[str]) -> tuple[str, str]:
    if failed:
        return "fallback", failed
    if not plan.regional:
        why = next((ln for ln in logs if "whole diffusion model" in ln), "compile_transformer_blocks_only off")
        return "whole", why
    return "regional", ""


def run_case(name: str, backend: str, mode: str) -> dict:
    import torch
    from compile_core.run import engine
    from compile_core.plan import regions
    from compile_core.report.log import logger
    from compile_core.cache.registry import ReuseRegistry
    from compile_core.plan.settings import CompileSettings, build_compile_args
    import zoo_cases

    covers, build, make_inputs = zoo_cases.CASES[name]
    rec = {"case": name, "covers": covers}
    torch.manual_seed(0)
    model = build("cpu").eval()
    tiny._randomize(model, 0)
    rec["class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    inputs = [make_inputs("cpu", h, w) for h, w in SIZES]
    try:
        with torch.no_grad():
            eager = [model(**kw) for kw in inputs]
    except Exception as exc:  # noqa: BLE001 - the model itself cannot run here
        return {**rec, "status": "cpu", "reason": f"eager run failed: {type(exc).__name__}: {exc}"[:300]}

    handler = _Lines()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        extra = {"shape_policy": zoo_cases.POLICY[name]} if name in zoo_cases.POLICY else {}
        extra["background_compile"] = False  # graphs are counted in the first call
        settings = CompileSettings.from_args(build_compile_args(backend=backend, mode=mode, **extra))
        plan = regions.plan_regions(model, blocks_only=True)
        compiled = engine.prepare(model, settings, registry=ReuseRegistry())
        with torch.no_grad():
            called = _regions_called(model, plan, lambda: model(**inputs[0])) if plan.regional else 0
            graphs, outs, secs = [], [], []
            for kw in inputs:
                g0, t0 = tiny._graphs(), time.perf_counter()
                outs.append(compiled.run(model, lambda kw=kw: model(**kw), torch.device("cpu")))
                secs.append(round(time.perf_counter() - t0, 2))
                graphs.append(tiny._graphs() - g0)
    finally:
        logger.removeHandler(handler)
    status, reason = _status(plan, compiled.entry.failed, handler.lines)
    if status == "regional" and not called:
        status, reason = "not compiled", ("the model never calls its planned blocks (it calls other methods "
                                          "of them), so no compiled region runs")
    return {**rec, "status": status, "reason": reason, "family": plan.family,
            "blocks": compiled.description, "regions": len(plan.paths) if plan.regional else 0,
            "regions_called": called, "shape_policy": settings.shape_policy,
            "graphs_first": graphs[0], "graphs_second_size": graphs[1],
            "rel_l2": [_rel_l2(o, e) for o, e in zip(outs, eager)], "seconds": secs,
            "recompile_reasons": sorted({f["recompile_reason"][:300] for f in compiled.entry.frames
                                         if f["recompile_reason"]}),
            "sizes": [list(s) for s in SIZES]}


def write_table(records: list[dict], command: str, backend: str, mode: str, json_path, md_path) -> None:
    import torch
    meta = {"command": command, "backend": backend, "mode": mode, "torch": torch.__version__,
            "comfyui": tiny.COMFY_DIR.name, "sizes": [list(s) for s in SIZES]}
    if json_path:
        Path(json_path).write_text(json.dumps({**meta, "models": records}, indent=1) + "\n")
    if md_path:
        Path(md_path).write_text(markdown(records, meta))


def markdown(records: list[dict], meta: dict) -> str:
    regional = sum(r.get("status") == "regional" for r in records)
    good = sum(_good(r) for r in records)
    head = (f"Model zoo: {meta['comfyui']}, torch {meta['torch']}, CPU, tiny random models, backend "
            f"`{meta['backend']}`{' (not inductor: dynamo decides the graph counts)' if meta['backend'] != 'inductor' else ''}, "
            f"mode `{meta['mode']}`, latent {meta['sizes'][0]} then {meta['sizes'][1]}.\n"
            f"{regional}/{len(records)} compile regionally; {good}/{len(records)} regionally with rel L2 "
            f"<= 1e-3 and no new graph at the second size.\n\nMade by `{meta['command']}` (`--cases a,b` re-runs "
            f"those rows).\n\n")
    rows = ["| model | covers | status | blocks | graphs | new graphs at 2nd size | rel L2 (1st, 2nd) | note |",
            "|---|---|---|---|---|---|---|---|"]
    for r in records:
        l2 = ", ".join(f"{v:.1e}" for v in r.get("rel_l2", [])) or "-"
        rows.append(f"| {r['case']} | {r.get('covers', '')} | {r.get('status', 'error')} | {r.get('blocks', '-')} | "
                    f"{r.get('graphs_first', '-')} | {r.get('graphs_second_size', '-')} | {l2} | "
                    f"{_md(_note(r))} |")
    return head + "\n".join(rows) + "\n" + _coverage(records) + _not_covered()


def supported_entries() -> list[str]:
    """The names in the host's ``comfy/supported_models.py`` ``models = [...]`` list."""
    import re
    text = (tiny.COMFY_DIR / "comfy" / "supported_models.py").read_text()
    return re.findall(r"\b(\w+),", text[text.index("\nmodels = ["):].split("]", 1)[0])


def _covered_by(entry: str, covers: str) -> bool:
    import re
    names = re.findall(r"[\w*]+", covers)
    return entry in names or any(n.endswith("*") and entry.startswith(n[:-1]) for n in names)


def _coverage(records: list[dict]) -> str:
    """Per ``supported_models`` entry (the diffusion ones: all but ``NOT_DIFFUSION``'s): how many a
    good row covers."""
    import zoo_cases
    out_of_scope = {n.strip() for v in zoo_cases.NOT_DIFFUSION.values() for n in v.split(",")}
    entries = [e for e in supported_entries() if e not in out_of_scope]
    good = [e for e in entries if any(_good(r) and _covered_by(e, r.get("covers", "")) for r in records)]
    bad = [e for e in entries if e not in good]
    return (f"\nCoverage: {len(good)}/{len(entries)} ({100 * len(good) / len(entries):.0f} %) of the diffusion "
            f"model entries of `comfy/supported_models.py`'s `models` list ({len(out_of_scope)} non-diffusion "
            f"entries left out) compile regionally within 1e-3 of eager with no new graph at the second size. "
            f"Not (yet): {', '.join(bad) or 'none'}.\n")


def _not_covered() -> str:
    import zoo_cases
    no_case = "; ".join(f"{k} ({v})" for k, v in zoo_cases.NO_CASE_YET.items())
    not_dm = "; ".join(f"{k} ({v})" for k, v in zoo_cases.NOT_DIFFUSION.items())
    return (f"\nNo tiny case yet (not run): {no_case}.\n\n"
            f"Not diffusion models (out of scope): {not_dm}.\n")


def _note(r: dict) -> str:
    """Why a case is not simply good: its status reason, or what made the second size recompile."""
    if r.get("reason") or r.get("error"):
        return r.get("reason") or r.get("error")
    if r.get("graphs_second_size"):
        return "recompiled at the 2nd size: " + "; ".join(x.split("\n")[0][:90] for x in r.get("recompile_reasons", [])[:2])
    return ""


def _good(r: dict) -> bool:
    return (r.get("status") == "regional" and r.get("graphs_second_size") == 0
            and r.get("regions_called") == r.get("regions")
            and max(r.get("rel_l2", [1.0])) <= 1e-3)


def _md(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")[:200]


def main(argv=None) -> int:
    import zoo_cases
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(c for c in zoo_cases.CASES if c not in zoo_cases.TEST_ONLY))
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--mode", default="default")
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--merge", action="store_true", help="update these cases' rows of the --json table")
    ap.add_argument("--from-jsonl", default="", help="only write the table from a run's stdout")
    args = ap.parse_args(argv)
    # setup_host() moves into the ComfyUI folder: resolve the output paths first
    args.json, args.md = (str(Path(p).resolve()) if p else "" for p in (args.json, args.md))
    if args.from_jsonl:
        records = [json.loads(ln) for ln in Path(args.from_jsonl).read_text().splitlines() if ln.startswith("{")]
        records = list({r["case"]: r for r in records}.values())  # a later line re-runs a case
        records = [r for r in records if r["case"] not in zoo_cases.TEST_ONLY]
        done = {r["case"] for r in records}
        records += [{"case": c, "covers": v[0], "status": "not run", "reason": "run cut short (CPU time)"}
                    for c, v in zoo_cases.CASES.items() if c not in done and c not in zoo_cases.TEST_ONLY]
        write_table(records, os.environ.get("TCS_ZOO_SCRIPT") or " ".join(sys.argv), args.backend,
                    args.mode, args.json, args.md)
        return 0
    command = os.environ.get("TCS_ZOO_SCRIPT") or " ".join(sys.argv)

    tiny.setup_host()
    importlib.import_module("comfy.patcher_extension")  # a server has it loaded; kandinsky5 relies on it
    records, rc = [], 0
    stdout, sys.stdout = sys.stdout, sys.stderr  # keep library chatter off the JSON channel
    for name in filter(None, args.cases.split(",")):
        t0 = time.perf_counter()
        try:
            rec = run_case(name, args.backend, args.mode)
        except Exception as exc:  # noqa: BLE001 - reported per case
            rec = {"case": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300],
                   "traceback": traceback.format_exc()}
            rc = 1
        rec["case_seconds"] = round(time.perf_counter() - t0, 1)
        records.append(rec)
        print(json.dumps(rec), file=stdout, flush=True)
    if args.merge:
        records = merged(records, args.json, args.backend, args.mode)
    write_table(records, command, args.backend, args.mode, args.json, args.md)
    return rc


def merged(records: list[dict], json_path: str, backend: str, mode: str) -> list[dict]:
    """This run's records over the table already in ``json_path`` (same backend, mode and host;
    else only this run's), in ``zoo_cases.CASES`` order: a partial re-run updates its rows."""
    import torch
    import zoo_cases
    old = json.loads(Path(json_path).read_text()) if json_path and Path(json_path).is_file() else {}
    same = (old.get("backend"), old.get("mode"), old.get("comfyui"), old.get("torch")) == \
        (backend, mode, tiny.COMFY_DIR.name, torch.__version__)
    by_case = {r["case"]: r for r in (old.get("models", []) if same else [])}
    by_case.update((r["case"], r) for r in records)
    return [by_case[c] for c in zoo_cases.CASES if c in by_case]


if __name__ == "__main__":
    sys.exit(main())
