// The web page of `ggml-coordinator serve`: a streaming chat over
// /v1/chat/completions and the live cluster view over /cluster/events
// (docs/operations.md). Plain JavaScript, no build step, nothing fetched from
// anywhere but this server. Text from the server is set with textContent only.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const STALE_AFTER_MS = 3000;  // no snapshot for this long: the view says it is stale
  const RETRY_MS = 1000;        // the cluster stream reconnects after this
  const MAX_EVENTS_SHOWN = 100;

  const authRequired = document.querySelector('meta[name="auth-required"]').content === "true";
  let apiKey = sessionStorage.getItem("ggml-distributed-api-key") || "";
  let modelName = null;
  const history = [];  // the conversation sent with every request: {role, content}

  function authHeaders(extra) {
    const headers = Object.assign({}, extra);
    if (apiKey) headers["Authorization"] = "Bearer " + apiKey;
    return headers;
  }

  function askForKey(message) {
    $("key-form").hidden = false;
    $("key-error").textContent = message || "";
    $("key-input").focus();
  }

  // ------------------------------------------------------------ Server-Sent Events over fetch
  // (EventSource cannot send the Authorization header)
  async function* sseEvents(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const ev = { event: "message", id: null, data: [] };
        for (const line of block.split("\n")) {
          const colon = line.indexOf(":");
          if (colon === 0) continue;  // a comment
          const name = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (name === "data") ev.data.push(value);
          else if (name === "event") ev.event = value;
          else if (name === "id") ev.id = value;
        }
        if (ev.data.length) yield { event: ev.event, id: ev.id, data: ev.data.join("\n") };
      }
    }
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  // ------------------------------------------------------------ formatting
  function bytes(n) {
    if (n == null) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n < 10 ? 2 : 1) : String(n)) + " " + units[i];
  }
  function seconds(s) {
    if (s == null) return "—";
    if (s < 0.001) return (s * 1e6).toFixed(0) + " µs";
    if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms";
    return s.toFixed(2) + " s";
  }
  function duration(s) {
    if (s < 10) return s.toFixed(1) + " s";
    if (s < 60) return s.toFixed(0) + " s";
    if (s < 3600) return (s / 60).toFixed(0) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text != null) node.textContent = text;
    return node;
  }
  // a figure with its age: fresh ones plain, older ones say how old, never passed off as live
  function aged(cell, figure, text, ageSeconds, old) {
    cell.replaceChildren();
    if (figure == null) { cell.textContent = "—"; return; }
    const age = figure.age_seconds + ageSeconds;
    const stale = old || age > 2.5;
    cell.append(el("span", stale ? "stale" : "", text));
    if (stale) cell.append(" ", el("span", "age", "(" + duration(age) + " ago)"));
  }

  // ------------------------------------------------------------ the cluster view
  let lastEventId = 0;
  let snapshot = null;
  let snapshotAt = 0;  // performance.now() when it arrived
  const rows = new Map();  // endpoint -> its <tr>

  function setLink(state, text) {
    const link = $("cluster-link");
    link.dataset.link = state;
    link.textContent = text;
  }

  function workerRow(endpoint) {
    let tr = rows.get(endpoint);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.endpoint = endpoint;
      for (const name of ["index", "endpoint", "layers", "head", "state", "ping", "step", "memory", "busy"]) {
        tr.append(el("td", "col-" + name));
      }
      // a failure's cause is long: on a row of its own, under the worker's
      const detail = document.createElement("tr");
      detail.className = "failure-detail";
      detail.dataset.detailFor = endpoint;
      detail.hidden = true;
      const cell = el("td", "cause");
      cell.colSpan = tr.cells.length;
      detail.append(cell);
      $("workers").tBodies[0].append(tr, detail);
      rows.set(endpoint, tr);
    }
    return tr;
  }

  // "tensor split (auto: 1.3 ms of exchanges a token against 5.5 ms saved, exact sums)": the split and why
  function splitText(mode, choice) {
    const why = [];
    if (choice && choice.asked === "auto") {
      why.push(choice.reason != null ? "auto: " + choice.reason
        : "auto: " + choice.exchanges_ms_per_token + " ms of exchanges a token against " +
          choice.compute_saved_ms_per_token + " ms saved");
    } else if (choice && choice.asked === "tensor" && mode === "tensor") {
      why.push("asked");
    }
    if (choice && choice.sums) why.push(choice.sums + " sums");
    return (mode || "layer") + " split" + (why.length ? " (" + why.join(", ") + ")" : "");
  }

  function renderSnapshot() {
    if (!snapshot) return;
    const sinceArrival = (performance.now() - snapshotAt) / 1000;
    const stale = sinceArrival * 1000 > STALE_AFTER_MS;
    const status = $("status");
    status.dataset.status = stale ? "stale" : snapshot.status;
    status.textContent = stale ? "no news for " + duration(sinceArrival) : snapshot.status;
    if (!modelName && snapshot.model) modelName = snapshot.model;
    $("model").textContent = snapshot.model;
    $("rate").textContent = snapshot.tokens_per_second == null ? "" : snapshot.tokens_per_second.toFixed(1) + " tokens/s";
    $("slots").textContent = snapshot.slots_busy + "/" + snapshot.slots + " slots busy" +
      (snapshot.requests_waiting ? ", " + snapshot.requests_waiting + " waiting" : "");
    $("split").textContent = splitText(snapshot.split_mode, snapshot.split_choice);
    $("split").title = Object.entries(snapshot.split_choice || {}).map(([k, v]) => k + ": " + v).join("\n");
    for (const w of snapshot.workers) {
      const tr = workerRow(w.endpoint);
      tr.dataset.state = w.state;
      const c = tr.cells;
      c[0].textContent = String(w.index);
      c[1].textContent = w.endpoint;
      c[2].textContent = w.shard
        ? (w.layers && (w.layers[0] > 0 || w.layers[1] < snapshot.n_layer)
            ? w.layers[0] + "–" + (w.layers[1] - 1) + " (group " + (w.shard.group + 1) + ")" : "all") +
          ", shard " + (w.shard.rank + 1) + "/" + w.shard.of + ": heads " + w.shard.heads[0] + "–" +
          (w.shard.heads[1] - 1) + (w.shard.kv_replicated ? " (KV copied)" : "") + ", FFN rows " +
          w.shard.ffn_rows[0] + "–" + (w.shard.ffn_rows[1] - 1) +
          (w.shard.embd_rows ? ", vocabulary rows " + w.shard.embd_rows[0] + "–" + (w.shard.embd_rows[1] - 1) : "") +
          (w.shard.out_rows ? ", output rows " + w.shard.out_rows[0] + "–" + (w.shard.out_rows[1] - 1) + " (exact sums)"
            : " (split sums)")
        : w.layers[0] + "–" + (w.layers[1] - 1) + " (" + (w.layers[1] - w.layers[0]) + ")";
      c[3].textContent = (w.head_share * 100).toFixed(w.head_share > 0 && w.head_share < 0.1 ? 1 : 0) + " %";
      c[4].replaceChildren();
      const badge = el("span", "state", w.state);
      badge.dataset.state = w.state;
      c[4].append(badge);
      const detail = tr.nextElementSibling;
      detail.hidden = !w.failure;
      if (w.failure) {
        const f = w.failure;
        c[4].append(" ", el("span", "age", f.kind + ", " + duration(f.down_seconds + sinceArrival)));
        let note = f.cause;
        if (f.attempts) note += " · " + f.attempts + " reconnect attempt" + (f.attempts > 1 ? "s" : "") + " failed";
        if (f.next_attempt_in_seconds != null) {
          note += " · next attempt in " + duration(Math.max(0, f.next_attempt_in_seconds - sinceArrival));
        }
        detail.cells[0].textContent = note;
      }
      // a failed worker's figures are from before it failed: always shown with their age
      const old = w.state !== "ok";
      aged(c[5], w.ping, w.ping && seconds(w.ping.rtt_seconds), sinceArrival, old);
      aged(c[6], w.step_rtt, w.step_rtt && seconds(w.step_rtt.seconds), sinceArrival, old);
      aged(c[7], w.memory, w.memory && bytes(w.memory.used_bytes) + " / " + bytes(w.memory.free_bytes), sinceArrival, old);
      aged(c[8], w.compute_busy, w.compute_busy && (w.compute_busy.fraction * 100).toFixed(0) + " %", sinceArrival, old);
      if (w.probe_error && !old) c[5].append(el("span", "probe-error", "probe: " + w.probe_error.message));
    }
  }

  function addEvent(ev) {
    if (ev.id <= lastEventId) return;
    lastEventId = ev.id;
    const li = el("li");
    li.dataset.kind = ev.kind;
    li.dataset.endpoint = ev.endpoint;
    const when = el("time", "", new Date(ev.time * 1000).toLocaleTimeString());
    when.dateTime = new Date(ev.time * 1000).toISOString();
    li.append(when, el("span", "kind", ev.kind.replace("_", " ")), el("span", "", ev.message));
    const list = $("events");
    list.prepend(li);
    while (list.children.length > MAX_EVENTS_SHOWN) list.lastChild.remove();
  }

  async function watchCluster() {
    for (;;) {  // for the page's life: reconnect after any loss
      try {
        const headers = authHeaders(lastEventId ? { "Last-Event-ID": String(lastEventId) } : {});
        const response = await fetch("/cluster/events", { headers, cache: "no-store" });
        if (response.status === 401) {
          setLink("key", "API key needed");
          askForKey(apiKey ? "the server refused this key" : "");
          return;  // the key form starts it again
        }
        if (!response.ok) throw new Error("HTTP " + response.status);
        setLink("live", "live");
        for await (const ev of sseEvents(response)) {
          if (ev.event === "snapshot") {
            snapshot = JSON.parse(ev.data);
            // a restarted server counts its events from 1 again
            if (snapshot.last_event_id < lastEventId) lastEventId = snapshot.last_event_id;
            snapshotAt = performance.now();
            renderSnapshot();
          } else if (ev.event === "cluster_event") {
            addEvent(JSON.parse(ev.data));
          }
        }
      } catch (err) {
        // the server went away or restarted: said on the page, then retried
      }
      setLink("lost", "connection to the server lost; retrying");
      await sleep(RETRY_MS);
    }
  }
  setInterval(renderSnapshot, 500);  // ages move on between snapshots; a silent server shows as stale

  // ------------------------------------------------------------ the chat
  let chatAbort = null;

  function addMessage(role, text) {
    const div = el("div", "msg " + role);
    div.append(el("span", "who", role === "user" ? "you" : "assistant"), el("span", "text", text));
    $("messages").append(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
  }

  async function send(text) {
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const bubble = addMessage("assistant", "");
    const out = bubble.querySelector(".text");
    bubble.dataset.state = "waiting";
    const controller = new AbortController();
    chatAbort = controller;
    busy(true);
    const body = { messages: history.slice(), stream: true };
    if (modelName) body.model = modelName;
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const temperature = parseFloat($("temperature").value);
    if (temperature >= 0) body.temperature = temperature;
    let answer = "";
    let finish = null;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: authHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify(body), signal: controller.signal,
      });
      if (response.status === 401) {
        askForKey("the server wants an API key");
        throw new Error("API key needed");
      }
      if (!response.ok) {
        const err = await response.json().catch(() => null);
        throw new Error((err && err.error && err.error.message) || "HTTP " + response.status);
      }
      bubble.dataset.state = "streaming";
      for await (const ev of sseEvents(response)) {
        if (ev.data === "[DONE]") break;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          out.textContent = answer;
          bubble.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      bubble.dataset.state = "done";
      if (finish === "length") bubble.append(el("span", "note", "(stopped at the token limit)"));
    } catch (err) {
      const stopped = controller.signal.aborted;
      bubble.dataset.state = stopped ? "stopped" : "error";
      bubble.append(el("span", stopped ? "note" : "note error", stopped ? "(stopped)" : String(err.message || err)));
    } finally {
      if (answer) history.push({ role: "assistant", content: answer });
      else history.pop();  // nothing came back: the next message does not carry this one
      chatAbort = null;
      busy(false);
    }
  }

  // ------------------------------------------------------------ wiring
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || chatAbort) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => chatAbort && chatAbort.abort());
  $("clear").addEventListener("click", () => {
    if (chatAbort) chatAbort.abort();
    history.length = 0;
    $("messages").replaceChildren();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("key-input").value.trim();
    sessionStorage.setItem("ggml-distributed-api-key", apiKey);
    $("key-form").hidden = true;
    watchCluster();
  });

  if (authRequired && !apiKey) {
    setLink("key", "API key needed");
    askForKey("");
  } else {
    watchCluster();
  }
})();
