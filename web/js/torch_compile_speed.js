// TorchCompileSpeed frontend extension (ComfyUI frontend 1.32+; plain ES module, no build step).
//
// 1. "Apply Torch Compile" nodes show a status badge: the server sends
//    `torch_compile_speed.status` (compile_core/status.py) after the node runs and whenever a
//    sampling run compiled, recompiled or fell back. The last payload is kept on the node as
//    `node.tcsStatus`, the badge text as `node.tcsBadge` (both read by tests/browser).
// 2. "Torch Compile Speed Settings" greys out widgets that have no effect: the PTX options while
//    experimental_ptx is off, and backend/dynamic while mode is "speed" (which sets them).
//    Widgets are only *disabled*, never removed or reordered, and their values are untouched:
//    UI-format workflows store widget values by position.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const EXTENSION = "TorchCompileSpeed.UI";
const STATUS_EVENT = "torch_compile_speed.status";
const SETTINGS_NODE = "TorchCompileSpeedSettings";
const APPLY_NODE = "ApplyTorchCompile";
const BADGE_NODES = [APPLY_NODE, "ApplyTorchCompileVAE"];  // nodes that show the status badge
const DIAGNOSTICS_NODE = "TorchCompileDiagnostics";

const PTX_DEPENDENTS = ["ptx_fast_math", "warmup_runs", "ptx_cache_dir"];
const SPEED_OVERRIDES = ["backend", "dynamic"];
const DEPENDENTS = [...PTX_DEPENDENTS, ...SPEED_OVERRIDES];
const DRIVERS = ["experimental_ptx", "mode", "declared_shapes"];

const STATES = {
  pending: { label: "pending (not run yet)", color: "#9aa0a6" },
  compiling: { label: "compiling… (first step)", color: "#d29922" },
  "background-after-run": { label: "compiles when the server is idle (running eagerly)", color: "#d29922" },
  "compiling-background": { label: "compiling in the background (running eagerly)", color: "#d29922" },
  cold: { label: "compiled (cold)", color: "#f0b232" },
  warm: { label: "warm (compile cache)", color: "#58a6ff" },
  reused: { label: "reused (in memory)", color: "#3fb950" },
  "eager-fallback": { label: "eager fallback", color: "#f85149" },
  "eager-slower": { label: "eager (compiled was not faster here)", color: "#9aa0a6" },
};

const BADGE = { font: "12px Arial, sans-serif", lineHeight: 16, pad: 6, margin: 6, minWidth: 270 };

// ------------------------------------------------------------------ settings node: widget state

function widget(node, name) {
  return node.widgets?.find((w) => w.name === name);
}

/** Which widgets are inert for the current values: {name: reason}. */
function inertWidgets(node) {
  const out = {};
  if (!widget(node, "experimental_ptx")?.value) {
    for (const name of PTX_DEPENDENTS) out[name] = "only used with experimental_ptx";
    // warmup_runs also drives compile-ahead when sizes are declared
    if (String(widget(node, "declared_shapes")?.value ?? "").trim()) delete out.warmup_runs;
  }
  if (widget(node, "mode")?.value === "speed") {
    for (const name of SPEED_OVERRIDES) out[name] = "mode 'speed' sets this (inductor, dynamic)";
  }
  return out;
}

/** Grey out (disable) the inert widgets and re-enable the others. Never touches values/order. */
function syncSettingsWidgets(node) {
  if (!node?.widgets) return;
  const inert = inertWidgets(node);
  let changed = false;
  for (const name of DEPENDENTS) {
    const w = widget(node, name);
    if (!w) continue;
    const off = name in inert;
    // w.tcsDisabled marks a disable that is ours: a widget disabled by other code stays so.
    if (off && (!w.tcsDisabled || !w.disabled)) {
      w.disabled = true;
      w.tcsDisabled = true;
      w.tcsDisabledReason = inert[name];
      changed = true;
    } else if (!off && w.tcsDisabled) {
      w.disabled = false;
      w.tcsDisabled = false;
      w.tcsDisabledReason = undefined;
      changed = true;
    }
  }
  if (changed) node.setDirtyCanvas?.(true, true);
}

function hookSettingsWidgets(node) {
  for (const name of DRIVERS) {
    const w = widget(node, name);
    if (!w || w.tcsHooked) continue;
    const callback = w.callback;
    w.callback = function (...args) {
      const r = callback?.apply(this, args);
      syncSettingsWidgets(node);
      return r;
    };
    w.tcsHooked = true;
  }
}

// ------------------------------------------------------------------ apply node: status badge

function formatSeconds(s) {
  if (typeof s !== "number" || !isFinite(s)) return "?";
  if (s < 10) return `${s.toFixed(2)} s`;
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  return `${m}m ${String(Math.round(s - 60 * m)).padStart(2, "0")}s`;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

/** The badge for one status payload: {color, lines[]} (plain data, so tests can read it). */
function badgeFor(status) {
  const st = STATES[status.state] ?? { label: String(status.state), color: "#9aa0a6" };
  const lines = [`torch.compile: ${st.label}`];
  const what = status.regional === false ? "whole model" : plural(status.region_count ?? 0, "region");
  const parts = [what];
  if (status.state !== "pending" && status.state !== "eager-fallback") {
    parts.push(`compile ${formatSeconds(status.compile_seconds)}`);
    parts.push(plural(status.recompiles ?? 0, "recompile"));
  }
  lines.push(parts.join(" · "));
  if (typeof status.speedup === "number" && isFinite(status.speedup)) {
    lines.push(`${status.speedup.toFixed(2)}× vs eager`);
  }
  let reason;
  if ((status.state === "eager-fallback" || status.state === "eager-slower") && status.fallback_reason) {
    reason = String(status.fallback_reason);
    lines.push(reason);
  }
  if (typeof status.swapped_at === "number") {
    lines.push(`compiled in the background, swapped in at step ${status.swapped_at}`);
  }
  const detail = [status.backend, status.mode].filter(Boolean).join(" / ");
  if (detail) lines.push(detail);
  if (status.memory) lines.push(status.memory);
  return { color: st.color, lines, reason };
}

let measureCtx = null;
function measurer() {
  measureCtx ??= document.createElement("canvas").getContext("2d");
  measureCtx.font = BADGE.font;
  return measureCtx;
}

/** Fit `text` into `maxLines` lines of at most `maxWidth` px, then an ellipsis. Lines made of
 * " · " separated parts break between parts; other text breaks between words. */
function wrapText(ctx, text, maxWidth, maxLines) {
  text = String(text);
  const sep = text.includes(" · ") ? " · " : " ";
  const words = text.split(sep === " " ? /\s+/ : sep).filter(Boolean);
  const lines = [];
  let cur = "";
  for (const word of words) {
    const next = cur ? `${cur}${sep}${word}` : word;
    if (!cur || ctx.measureText(next).width <= maxWidth) cur = next;
    else { lines.push(cur); cur = word; }
  }
  if (cur) lines.push(cur);
  const out = lines.slice(0, maxLines);
  if (lines.length > maxLines) out[maxLines - 1] += " …";
  return out.map((l) => truncate(ctx, l, maxWidth));
}

function truncate(ctx, text, maxWidth) {
  if (ctx.measureText(text).width <= maxWidth) return text;
  let lo = 0, hi = text.length;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (ctx.measureText(text.slice(0, mid) + "…").width <= maxWidth) lo = mid; else hi = mid - 1;
  }
  return text.slice(0, lo) + "…";
}

/** Display lines for the node's current width: [{text, color, source}] (cached per width;
 * `source` is the index in badge.lines that the display line comes from). */
function badgeLayout(node) {
  const badge = node.tcsBadge;
  const width = node.size[0];
  if (badge.layout?.width === width) return badge.layout.lines;
  const ctx = measurer();
  const maxText = width - 2 * BADGE.margin - 2 * BADGE.pad - 6;
  const lines = [];
  badge.lines.forEach((line, i) => {
    const long = line === badge.reason;  // the fallback reason may take 3 lines, others 1-2
    for (const text of wrapText(ctx, line, maxText, long ? 3 : 2)) {
      lines.push({ text, color: i === 0 ? badge.color : "#d0d0d0", source: i });
    }
  });
  badge.layout = { width, lines };
  return lines;
}

function badgeHeight(n) {
  return n * BADGE.lineHeight + 2 * BADGE.pad - 4;
}

/** Make room for the badge under the slots: the node becomes at least BADGE.minWidth wide (no
 * wider: long lines wrap instead, so the node does not grow over its neighbours) and tall
 * enough for the wrapped lines. */
function fitBadge(node) {
  if (!node.tcsBadge) return;
  const w = Math.max(node.size[0], BADGE.minWidth);
  if (w !== node.size[0]) node.setSize([w, node.size[1]]);
  const base = node.computeSize?.() ?? [node.size[0], 0];
  const h = Math.max(node.size[1], base[1] + badgeHeight(badgeLayout(node).length) + BADGE.margin);
  if (h !== node.size[1]) node.setSize([node.size[0], h]);
}

function drawBadge(node, ctx) {
  if (!node.tcsBadge || node.flags?.collapsed) return;
  const { pad, margin, lineHeight } = BADGE;
  const lines = badgeLayout(node);
  const h = badgeHeight(lines.length);
  const x = margin, y = node.size[1] - h - margin, w = node.size[0] - 2 * margin;
  if (w < 40 || y < 0) return;
  ctx.save();
  ctx.fillStyle = "rgba(0, 0, 0, 0.45)";
  ctx.beginPath();
  if (ctx.roundRect) ctx.roundRect(x, y, w, h, 5); else ctx.rect(x, y, w, h);
  ctx.fill();
  ctx.fillStyle = node.tcsBadge.color;
  ctx.fillRect(x, y + 3, 3, h - 6);
  ctx.font = BADGE.font;
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  lines.forEach((line, i) => {
    ctx.fillStyle = line.color;
    ctx.fillText(line.text, x + pad + 4, y + pad + i * lineHeight - 1);
  });
  ctx.restore();
}

/** The node a server-side unique id names ("12", or "5:12" inside a subgraph). */
function findNode(uniqueId) {
  if (uniqueId == null) return null;
  let graph = app.rootGraph ?? app.graph;
  let node = null;
  for (const part of String(uniqueId).split(":")) {
    if (!graph) return null;
    node = graph.getNodeById(part) ?? graph.getNodeById(Number(part));
    if (!node) return null;
    graph = node.subgraph;
  }
  return node;
}

function setStatus(node, status) {
  node.tcsStatus = status;
  node.tcsBadge = badgeFor(status);
  fitBadge(node);
  node.setDirtyCanvas?.(true, true);
}

function onStatus(event) {
  const status = event?.detail;
  if (!status || typeof status !== "object") return;
  const node = findNode(status.node);
  if (!node || !BADGE_NODES.includes(node.comfyClass ?? node.type)) return;
  setStatus(node, status);
}

// ------------------------------------------------------------------ registration

/** Show the Diagnostics node's report (its ui.text) in a read-only text box on the node. */
function showReport(node, text) {
  if (typeof text !== "string") return;
  let w = widget(node, "tcs_report");
  if (!w) {
    w = ComfyWidgets.STRING(node, "tcs_report", ["STRING", { multiline: true }], app).widget;
    // display only: never stored in the workflow (serialize) nor sent in a prompt (options)
    w.serialize = false;
    w.options = { ...(w.options ?? {}), serialize: false };
    if (w.inputEl) {
      w.inputEl.readOnly = true;
      w.inputEl.style.fontFamily = "monospace";
      w.inputEl.style.fontSize = "11px";
    }
  }
  w.value = text;
  node.tcsReport = text;
  node.setSize?.([Math.max(node.size[0], 520), Math.max(node.size[1], 360)]);
  node.setDirtyCanvas?.(true, true);
}

function chain(proto, method, after) {
  const original = proto[method];
  proto[method] = function (...args) {
    const r = original?.apply(this, args);
    after.apply(this, args);
    return r;
  };
}

app.registerExtension({
  name: EXTENSION,

  setup() {
    api.addEventListener(STATUS_EVENT, onStatus);
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name === SETTINGS_NODE) {
      chain(nodeType.prototype, "onNodeCreated", function () {
        hookSettingsWidgets(this);
        syncSettingsWidgets(this);
      });
      chain(nodeType.prototype, "onConfigure", function () {
        hookSettingsWidgets(this);
        syncSettingsWidgets(this);
      });
      chain(nodeType.prototype, "onWidgetChanged", function (name) {
        if (DRIVERS.includes(name)) syncSettingsWidgets(this);
      });
      // Safety net for value changes that bypass callbacks (undo, paste, other extensions):
      // the check is a few array lookups per frame and only marks the canvas dirty on change.
      chain(nodeType.prototype, "onDrawForeground", function () {
        syncSettingsWidgets(this);
      });
    } else if (nodeData?.name === DIAGNOSTICS_NODE) {
      chain(nodeType.prototype, "onExecuted", function (message) {
        showReport(this, message?.text?.[0]);
      });
    } else if (BADGE_NODES.includes(nodeData?.name)) {
      chain(nodeType.prototype, "onDrawForeground", function (ctx) {
        drawBadge(this, ctx);
      });
      chain(nodeType.prototype, "onResize", function () {
        // keep the badge readable if the user shrinks the node
        if (this.tcsBadge && !this.tcsFitting) {
          this.tcsFitting = true;
          try { fitBadge(this); } finally { this.tcsFitting = false; }
        }
      });
    }
  },

  loadedGraphNode(node) {
    if ((node.comfyClass ?? node.type) === SETTINGS_NODE) {
      hookSettingsWidgets(node);
      syncSettingsWidgets(node);
    }
  },
});

// For tests and debugging (e.g. window.TorchCompileSpeedUI.badgeFor(payload)).
window.TorchCompileSpeedUI = { EXTENSION, STATUS_EVENT, badgeFor, inertWidgets, syncSettingsWidgets, findNode };
