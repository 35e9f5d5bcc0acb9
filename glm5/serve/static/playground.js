// The glm5 playground (GET / of `glm5 serve`): chat with streaming, reasoning and tool-call cards, code infill,
// OCR (when the server runs with --ocr) and a live view of /metrics. Plain browser JavaScript, no build step.
// Every server call goes through api() with a route from ROUTES; tests/test_playground.py checks each one
// against the FastAPI app, so the page cannot drift off the public API. Errors shown are the API's own.
"use strict";

const ROUTES = {
  models: "GET /v1/models",
  chat: "POST /v1/chat/completions",
  infill: "POST /infill",
  ocr: "POST /v1/ocr",
  metrics: "GET /metrics",
};
const METRICS_EVERY_MS = 2000;

const $ = (id) => document.getElementById(id);
const state = {
  messages: [],        // the conversation as the API takes it (system prompt added per request)
  controller: null,    // AbortController of the running chat stream
  metricsTimer: null,
  timings: {firstPaintMs: null, firstTokenMs: null},  // read by the browser test; shown under each answer
};
window.playground = state;

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

// ---- the one way to reach the server -------------------------------------------------------------------
async function api(route, body, signal) {
  const [method, path] = ROUTES[route].split(" ");
  const headers = {};
  const key = $("api-key").value.trim();
  if (key) headers["Authorization"] = "Bearer " + key;
  let payload;
  if (body instanceof FormData) payload = body;
  else if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    payload = JSON.stringify(body);
  }
  const response = await fetch(path, {method, headers, body: payload, signal});
  if (!response.ok) throw new ApiError(response.status, await errorMessage(response));
  return response;
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const err = body.error || {};
    return `${response.status}: ${err.message || text}`;
  } catch {
    return `${response.status}: ${text || response.statusText}`;
  }
}

// Server-sent events from a fetch body: yields each `data:` JSON object until [DONE]; an error object in
// the stream (the engine failed mid-answer) is thrown.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const obj = JSON.parse(data);
      if (obj.error) throw new ApiError(0, obj.error.message);
      yield obj;
    }
  }
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// A number field as the API takes it: empty -> omitted (the server's default); anything else is sent as
// typed, so an out-of-range value gets the server's 400 naming the field.
function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

// ---- settings and models -------------------------------------------------------------------------------
async function loadModels() {
  const select = $("model");
  try {
    const list = await (await api("models")).json();
    select.replaceChildren();
    for (const card of list.data) {
      const label = card.parent ? `${card.id} (adapter on ${card.parent})` : card.id;
      select.append(new Option(label, card.id));
    }
    const base = list.data[0];
    $("server-status").textContent = `${base.id} · context ${base.max_model_len} · version ${base.model_version}`;
    showError("");
  } catch (e) {
    $("server-status").textContent = "";
    showError(`models: ${e.message}`);
  }
}

// OCR is on when POST /v1/ocr exists: an empty body is the route's own 400 ("image" missing), a 404 means
// the server runs without --ocr.
async function probeOcr() {
  let present = false;
  try {
    await api("ocr", {});
  } catch (e) {
    present = e.status === 400;
  }
  $("ocr-tab").hidden = !present;
}

function bindSliders() {
  for (const [id, out] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
    const show = () => { $(out).textContent = $(id).value; };
    $(id).addEventListener("input", show);
    show();
  }
}

function selectTab(name) {
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".panel")) p.classList.toggle("active", p.id === name);
  clearInterval(state.metricsTimer);
  state.metricsTimer = null;
  if (name === "metrics") {
    refreshMetrics();
    state.metricsTimer = setInterval(refreshMetrics, METRICS_EVERY_MS);
  }
}

// ---- chat ----------------------------------------------------------------------------------------------
function chatRequest() {
  const system = $("system").value.trim();
  const body = {
    model: $("model").value || undefined,
    messages: [...(system ? [{role: "system", content: system}] : []), ...state.messages],
    stream: true,
    stream_options: {include_usage: true},
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    max_tokens: numberField("max-tokens"),
    chat_template_kwargs: {enable_thinking: $("thinking").checked},
  };
  const tools = $("tools").value.trim();
  if (tools) {
    try {
      body.tools = JSON.parse(tools);
    } catch (e) {
      throw new ApiError(0, `tools: not JSON (${e.message})`);
    }
  }
  return body;
}

function userBubble(text) {
  const bubble = el("div", "msg user");
  bubble.append(el("div", "content", text));
  $("messages").append(bubble);
}

// An assistant bubble: collapsible reasoning, the answer, tool-call cards and a line of figures.
function assistantBubble() {
  const bubble = el("div", "msg assistant");
  bubble.dataset.state = "streaming";
  const reasoning = el("details", "reasoning");
  reasoning.hidden = true;
  reasoning.append(el("summary", "", "Reasoning"), el("pre", "reasoning-text"));
  const parts = {bubble, reasoning, reasoningText: reasoning.lastChild, content: el("div", "content"),
                 tools: el("div", "tools"), meta: el("div", "meta muted")};
  bubble.append(reasoning, parts.content, parts.tools, parts.meta);
  $("messages").append(bubble);
  return parts;
}

async function runChat() {
  showError("");
  const parts = assistantBubble();
  const answer = {content: "", reasoning: "", calls: [], finish: null, usage: null};
  const t0 = performance.now();
  let firstToken = null;
  state.timings.firstTokenMs = null;
  let outcome = "done";
  state.controller = new AbortController();
  setBusy(true);
  try {
    const response = await api("chat", chatRequest(), state.controller.signal);
    for await (const chunk of sseEvents(response)) {
      if (chunk.usage) answer.usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if ((delta.reasoning_content || delta.content) && firstToken === null) {
        firstToken = state.timings.firstTokenMs = performance.now() - t0;
      }
      applyDelta(parts, answer, delta);
      if (choice.finish_reason) answer.finish = choice.finish_reason;
    }
    state.messages.push(assistantMessage(answer));
  } catch (e) {
    const stopped = e.name === "AbortError";
    outcome = stopped ? "stopped" : "error";
    if (!stopped) {
      parts.bubble.append(el("div", "error-text", e.message));
      showError(e.message);
    }
    if (answer.content || answer.calls.length) state.messages.push(assistantMessage(answer));
  } finally {
    setBusy(false);
    state.controller = null;
  }
  parts.reasoning.open = false;
  if (answer.content) renderMarkdown(parts.content, answer.content);
  parts.meta.textContent = answerFigures(answer, firstToken, performance.now() - t0);
  parts.bubble.dataset.state = outcome;  // the browser test waits for this
  renderToolCards(parts, answer.calls);
}

function applyDelta(parts, answer, delta) {
  if (delta.reasoning_content) {
    answer.reasoning += delta.reasoning_content;
    parts.reasoning.hidden = false;
    if (!answer.content) parts.reasoning.open = true;  // open while the model thinks, closed once it answers
    parts.reasoningText.textContent = answer.reasoning;
  }
  if (delta.content) {
    answer.content += delta.content;
    parts.reasoning.open = false;
    parts.content.textContent = answer.content;
  }
  for (const call of delta.tool_calls || []) {  // OpenAI's deltas: id and name first, then argument pieces
    const slot = (answer.calls[call.index] ??= {id: "", name: "", arguments: ""});
    if (call.id) slot.id = call.id;
    if (call.function?.name) slot.name += call.function.name;
    if (call.function?.arguments) slot.arguments += call.function.arguments;
  }
  if (delta.tool_calls) renderToolCards(parts, answer.calls);
}

function assistantMessage(answer) {
  const msg = {role: "assistant", content: answer.content};
  if (answer.calls.length) {
    msg.tool_calls = answer.calls.map((c) => ({id: c.id, type: "function",
                                              function: {name: c.name, arguments: c.arguments}}));
  }
  return msg;
}

function answerFigures(answer, firstTokenMs, totalMs) {
  const bits = [];
  if (answer.usage) {
    const n = answer.usage.completion_tokens;
    bits.push(`${n} tokens`);
    if (firstTokenMs !== null && n > 1 && totalMs > firstTokenMs) {
      bits.push(`${((n - 1) / ((totalMs - firstTokenMs) / 1000)).toFixed(1)} tok/s`);
    }
  }
  if (firstTokenMs !== null) bits.push(`first token ${Math.round(firstTokenMs)} ms`);
  if (answer.finish) bits.push(answer.finish);
  return bits.join(" · ");
}

// One card per tool call: name, arguments (pretty when they are JSON) and a box to answer with the tool's
// result, which continues the conversation as a `tool` message.
function renderToolCards(parts, calls) {
  parts.tools.replaceChildren();
  const finished = parts.bubble.dataset.state !== "streaming";
  for (const call of calls) {
    const card = el("div", "tool-card");
    const head = el("div", "tool-head");
    head.append(el("strong", "", call.name || "…"), el("span", "muted", call.id));
    let args = call.arguments;
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* still streaming or not JSON */ }
    card.append(head, el("pre", "tool-args", args));
    if (finished) {
      const result = el("textarea", "tool-result");
      result.rows = 2;
      result.placeholder = "tool result to send back";
      const send = el("button", "", "Send result");
      send.addEventListener("click", () => {
        state.messages.push({role: "tool", tool_call_id: call.id, content: result.value});
        send.disabled = true;
        runChat();
      });
      card.append(result, send);
    }
    parts.tools.append(card);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function sendPrompt(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  $("prompt").value = "";
  state.messages.push({role: "user", content: text});
  userBubble(text);
  runChat();
}

// ---- infill --------------------------------------------------------------------------------------------
async function runInfill() {
  showError("");
  const prefix = $("infill-prefix").value, suffix = $("infill-suffix").value;
  const out = $("infill-out"), info = $("infill-info");
  const middle = el("mark");
  out.replaceChildren(el("span", "muted", prefix), middle, el("span", "muted", suffix));
  info.textContent = "";
  $("infill-run").disabled = true;
  try {
    const response = await api("infill", {
      model: $("model").value || undefined, input_prefix: prefix, input_suffix: suffix, stream: true,
      n_predict: numberField("max-tokens"), temperature: numberField("temperature"), top_p: numberField("top-p"),
    });
    for await (const chunk of sseEvents(response)) {
      middle.textContent += chunk.content;
      if (chunk.stop) {
        info.textContent = `${chunk.tokens_predicted} tokens · stopped by ${chunk.stop_type} · format ` +
          `${chunk.infill_format}` + (chunk.truncated ? ` · context cut by ${chunk.truncated_tokens} tokens` : "");
      }
    }
  } catch (e) {
    info.textContent = e.message;  // e.g. the 400 of a model without FIM tokens, in the server's words
    showError(e.message);
  } finally {
    $("infill-run").disabled = false;
  }
}

// ---- OCR -----------------------------------------------------------------------------------------------
async function runOcr() {
  const file = $("ocr-file").files[0];
  if (!file) return;
  showError("");
  $("ocr-preview").src = URL.createObjectURL(file);
  $("ocr-md").replaceChildren(el("p", "muted", "reading…"));
  $("ocr-lines").replaceChildren();
  const form = new FormData();
  form.append("file", file);
  form.append("format", "md");
  try {
    const page = await (await api("ocr", form)).json();
    renderMarkdown($("ocr-md"), page.text || "(no text found)");
    renderOcrLines(page.page);
  } catch (e) {
    $("ocr-md").replaceChildren(el("p", "error-text", e.message));
    showError(e.message);
  }
}

function renderOcrLines(page) {
  const table = $("ocr-lines");
  const head = el("tr");
  for (const h of ["line", "text", "confidence", "source"]) head.append(el("th", "", h));
  table.replaceChildren(head);
  for (const block of page.blocks) {
    for (const line of block.lines) {
      const row = el("tr");
      const conf = el("td", "conf " + confidenceClass(line.confidence), `${(100 * line.confidence).toFixed(1)} %`);
      row.append(el("td", "", String(line.id)), el("td", "", line.text), conf, el("td", "muted", line.source));
      table.append(row);
    }
  }
}

function confidenceClass(c) {
  return c >= 0.95 ? "high" : c >= 0.8 ? "mid" : "low";
}

// A small, safe Markdown renderer for what the OCR agent and chat answers write: headings, lists, fenced
// code, pipe tables, paragraphs; inline code, bold and backslash escapes. It only ever sets textContent.
function renderMarkdown(target, text) {
  target.replaceChildren();
  const lines = text.replace(/\r\n/g, "\n").split("\n");
  for (let i = 0; i < lines.length;) {
    const line = lines[i];
    if (line.startsWith("```")) {
      const end = lines.indexOf("```", i + 1) < 0 ? lines.length : lines.indexOf("```", i + 1);
      target.append(el("pre", "code", lines.slice(i + 1, end).join("\n")));
      i = end + 1;
    } else if (/^#{1,6} /.test(line)) {
      const level = line.indexOf(" ");
      target.append(inline(el("h" + Math.min(level + 1, 6)), line.slice(level + 1)));
      i += 1;
    } else if (/^\s*([-*+]|\d+[.)]) /.test(line)) {
      const ordered = /^\s*\d/.test(line), list = el(ordered ? "ol" : "ul");
      for (; i < lines.length && /^\s*([-*+]|\d+[.)]) /.test(lines[i]); i++) {
        list.append(inline(el("li"), lines[i].replace(/^\s*([-*+]|\d+[.)]) /, "")));
      }
      target.append(list);
    } else if (line.startsWith("|")) {
      const table = el("table", "md-table");
      for (; i < lines.length && lines[i].startsWith("|"); i++) {
        if (/^\|[\s:|-]+\|$/.test(lines[i])) continue;  // the header separator row
        const row = el("tr");
        for (const cell of lines[i].slice(1, -1).split("|")) row.append(inline(el("td"), cell.trim()));
        table.append(row);
      }
      target.append(table);
    } else if (line.trim() === "") {
      i += 1;
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() !== "" && !/^(```|#{1,6} |\||\s*([-*+]|\d+[.)]) )/.test(lines[i]); i++) {
        para.push(lines[i]);
      }
      target.append(inline(el("p"), para.join("\n")));
    }
  }
}

function inline(node, text) {
  // `code` and **bold** spans; a backslash escapes the next character
  for (const piece of text.split(/(`[^`]+`|\*\*[^*]+\*\*)/)) {
    if (piece.startsWith("`") && piece.endsWith("`") && piece.length > 1) node.append(el("code", "", piece.slice(1, -1)));
    else if (piece.startsWith("**") && piece.endsWith("**") && piece.length > 3) node.append(el("strong", "", unescape(piece.slice(2, -2))));
    else node.append(unescape(piece));
  }
  return node;
}

function unescape(text) {
  return text.replace(/\\([\\`*_{}\[\]()#+\-.!|>])/g, "$1");
}

// ---- metrics -------------------------------------------------------------------------------------------
// Prometheus text -> [{name, labels, value}]
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$/);
    if (!m) continue;  // comments, blank lines
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v.replace(/\\(.)/g, "$1");
    samples.push({name: m[1], labels, value: Number(m[3])});
  }
  return samples;
}

function total(samples, name) {
  return samples.filter((s) => s.name === name).reduce((sum, s) => sum + s.value, 0);
}

async function refreshMetrics() {
  try {
    const samples = parseMetrics(await (await api("metrics")).text());
    renderSummary(samples);
    renderSpec(samples);
    renderExperts(samples);
  } catch (e) {
    showError(`metrics: ${e.message}`);
  }
}

function renderSummary(s) {
  const ttftCount = total(s, "vllm:time_to_first_token_seconds_count");
  const cards = [
    ["running", total(s, "vllm:num_requests_running")],
    ["waiting", total(s, "vllm:num_requests_waiting")],
    ["KV cache used", `${(100 * total(s, "vllm:kv_cache_usage_perc")).toFixed(1)} %`],
    ["prefix-cache hit rate", `${(100 * total(s, "vllm:gpu_prefix_cache_hit_rate")).toFixed(1)} %`],
    ["requests done", total(s, "vllm:request_success_total")],
    ["prompt tokens", total(s, "vllm:prompt_tokens_total")],
    ["generated tokens", total(s, "vllm:generation_tokens_total")],
    ["mean TTFT", ttftCount ? `${(1000 * total(s, "vllm:time_to_first_token_seconds_sum") / ttftCount).toFixed(0)} ms` : "–"],
  ];
  $("metrics-summary").replaceChildren(...cards.map(([label, value]) => figure(label, value)));
}

function figure(label, value) {
  const card = el("div", "card");
  card.dataset.metric = label;
  card.append(el("div", "figure", String(value)), el("div", "muted", label));
  return card;
}

function renderSpec(s) {
  const box = $("spec");
  if (!s.some((x) => x.name === "vllm:spec_decode_num_drafts_total")) {
    box.replaceChildren(el("p", "muted", "The engine does not draft (no MTP speculation): no vllm:spec_decode_* series."));
    return;
  }
  const drafts = total(s, "vllm:spec_decode_num_drafts_total");
  const draftTokens = total(s, "vllm:spec_decode_num_draft_tokens_total");
  const accepted = total(s, "vllm:spec_decode_num_accepted_tokens_total");
  const cards = el("div", "cards");
  cards.append(figure("drafts", drafts), figure("draft tokens", draftTokens), figure("accepted", accepted),
               figure("acceptance rate", draftTokens ? `${(100 * accepted / draftTokens).toFixed(1)} %` : "–"),
               figure("mean accepted length", drafts ? (1 + accepted / drafts).toFixed(2) : "–"));
  const bars = el("div", "bars");
  const perPos = s.filter((x) => x.name === "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    .sort((a, b) => Number(a.labels.position) - Number(b.labels.position));
  for (const p of perPos) {  // acceptance of draft position k over all drafts
    const rate = drafts ? p.value / drafts : 0;
    bars.append(bar(`position ${p.labels.position}`, rate, `${(100 * rate).toFixed(1)} %`));
  }
  box.replaceChildren(cards, bars);
}

function bar(label, fraction, text) {
  const row = el("div", "bar-row");
  const track = el("div", "bar-track"), fill = el("div", "bar-fill");
  fill.style.width = `${Math.max(0, Math.min(1, fraction)) * 100}%`;
  track.append(fill);
  row.append(el("span", "bar-label", label), track, el("span", "bar-value", text));
  return row;
}

// One row per MoE layer: a cell per expert shaded by its share of the layer's busiest expert, and the
// layer's imbalance (max over mean tokens per expert, 1 = even).
function renderExperts(s) {
  const layers = new Map();
  for (const x of s.filter((x) => x.name === "glm5:moe_expert_tokens_total")) {
    const row = layers.get(x.labels.layer) ?? [];
    row[Number(x.labels.expert)] = x.value;
    layers.set(x.labels.layer, row);
  }
  const imbalance = Object.fromEntries(s.filter((x) => x.name === "glm5:moe_expert_load_imbalance")
    .map((x) => [x.labels.layer, x.value]));
  const box = $("experts");
  if (!layers.size) {
    box.replaceChildren(el("p", "muted", "No expert load yet: it appears after the first request (on a model with MoE layers)."));
    return;
  }
  const rows = [...layers.entries()].sort((a, b) => Number(a[0]) - Number(b[0])).map(([layer, counts]) => {
    const row = el("div", "expert-row");
    row.dataset.layer = layer;
    const busiest = Math.max(1, ...counts);
    const cells = el("div", "expert-cells");
    counts.forEach((n, e) => {
      const cell = el("div", "expert-cell");
      cell.style.opacity = String(0.08 + 0.92 * (n / busiest));
      cell.title = `layer ${layer}, expert ${e}: ${n} tokens`;
      cells.append(cell);
    });
    const sum = counts.reduce((a, b) => a + b, 0);
    row.append(el("span", "expert-label", `layer ${layer}`), cells,
               el("span", "expert-imbalance", `${sum} tokens · imbalance ${(imbalance[layer] ?? 0).toFixed(2)}`));
    return row;
  });
  box.replaceChildren(...rows);
}

// ---- start ---------------------------------------------------------------------------------------------
function recordFirstPaint() {
  const paint = performance.getEntriesByType("paint").find((p) => p.name === "first-contentful-paint");
  if (paint) state.timings.firstPaintMs = paint.startTime;
  else new PerformanceObserver((list, observer) => {
    state.timings.firstPaintMs = list.getEntries()[0].startTime;
    observer.disconnect();
  }).observe({type: "paint", buffered: true});
}

function start() {
  recordFirstPaint();
  bindSliders();
  $("api-key").value = sessionStorage.getItem("glm5-api-key") || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("glm5-api-key", $("api-key").value);
    loadModels();
    probeOcr();
  });
  for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => selectTab(b.dataset.tab));
  $("chat-form").addEventListener("submit", sendPrompt);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) sendPrompt(e);
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("messages").replaceChildren();
  });
  $("infill-run").addEventListener("click", runInfill);
  $("ocr-file").addEventListener("change", runOcr);
  loadModels();
  probeOcr();
}

start();
