// The adaptlm keyboard: a page that uses only the public HTTP API (fetch to its own origin), no dependencies.
//
// Two sessions: the one that adapts, and an unadapted twin created with `adaptation: {lr: 0, cache_weight: 0,
// copy_model: false, neural_cache: false}` (no gradient steps, nothing that remembers its text) that reads the same
// commits. The twin is the same model in the same context with its adapter held at zero, so its suggestions are
// the unadapted model's; the chart's unadapted line is observe's `static_bits`, which the twin's own bits match.
"use strict";

(() => {
  const SUGGEST_MAX_CONTEXT = 2048; // adaptlm_client/protocol.py: the most characters `context` may have
  const K = 3;
  // A commit ends at Enter, or at sentence-ending punctuation (closing quotes or brackets may follow) and a space.
  const BOUNDARY = /[.!?]["'\u201d\u2019)\]]*[ \t]|\n/g;
  // The rest of a word after the cursor: letters, marks, digits and apostrophes, as the server's words
  // (models/suggest.py).
  const WORD_REST = /^[\p{L}\p{M}\p{N}'\u2019]*/u;
  // New sessions for lost ones at most this often: a server that loses them at once (a store full of busy
  // sessions) must not be sent sessions in a loop.
  const RENEW_MIN_MS = 10_000;
  const encoder = new TextEncoder();

  const $ = (id) => document.getElementById(id);
  const text = $("text");
  const bar = $("bar");
  const barStatic = $("bar-static");
  const compare = $("compare");
  const chart = $("chart");
  const keyInput = $("key");

  const state = {
    key: new URLSearchParams(location.search).get("key") || "",
    generation: 0, // bumped by connect and reset: answers for an older one are dropped
    adapted: null, // session ids
    twin: null,
    committed: "", // what the sessions have read: a prefix of the text area until it is edited (see readUpTo)
    marks: [], // where each commit ends in `committed`: the sentence ends an edit goes back to
    observing: Promise.resolve(), // commits (and resets) are sent one after the other, in order
    read: {}, // per session id, what its answers acknowledged: {bytes, bits, static_bits}
    renewedAt: -Infinity, // when lost sessions were last made again
    requested: null, // the context of the latest suggest request
    seq: 0,
    controller: null,
    shown: null, // {context, prefix, words, spaced, wordsStatic, spacedStatic, ms}: what the bars show
    saved: 0,
    series: { adapted: [], static: [], twin: [], chars: [] }, // per commit: bits per character, characters
    bits: { adapted: 0, static: 0, chars: 0 },
  };

  class ApiError extends Error {
    constructor(status, message, { code = null, retryAfter = 1 } = {}) {
      super(message);
      this.status = status; // 0: no answer came (the server down or restarting, or the connection broke)
      this.code = code; // the error's `code`
      this.retryAfter = retryAfter;
    }
  }

  // No answer from the server itself, so the work may or may not have been done: the connection failed or broke,
  // or a proxy answered for it (docs/operations.md, "When a replica dies").
  const unanswered = (e) => e.status === 0 || e.status === 502 || e.status === 504;
  // The server no longer has the session (expired, evicted, a restart without a snapshot), or it is out of step
  // with what the page sent: new sessions read the text again.
  const renew = (e) => (e.status === 404 && e.code === "session_not_found") || e.code === "out_of_step";
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  async function api(path, body, { method = "POST", signal, keepalive = false } = {}) {
    const headers = { "content-type": "application/json" };
    if (state.key) headers.authorization = `Bearer ${state.key}`;
    const init = { method, headers, signal, keepalive };
    if (body !== undefined) init.body = JSON.stringify(body);
    // Relative to the page: /keyboard -> /v1/..., and the same behind a proxy's path prefix.
    let response;
    try {
      response = await fetch(`v1/${path}`, init);
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(0, "the server is not answering");
    }
    if (response.status === 204) return null;
    const data = await response.json().catch(() => null);
    if (!response.ok) {
      const message = data?.error?.message ?? `${response.status} ${response.statusText}`;
      const retryAfter = Number(response.headers.get("retry-after")) || 1;
      throw new ApiError(response.status, message, { code: data?.error?.code ?? null, retryAfter });
    }
    if (data === null) throw new ApiError(0, "the answer broke off"); // the connection broke during the body
    return data;
  }

  // 429 and 503 come before the server did any work: a commit waits and tries again rather than being lost.
  const busy = (e) => e.status === 429 || e.status === 503;
  async function withRetry(call, tries = 3) {
    for (let i = 1; ; i++) {
      try {
        return await call();
      } catch (e) {
        if (i >= tries || !busy(e)) throw e;
        await sleep(1000 * e.retryAfter);
      }
    }
  }

  function setStatus(kind, message) {
    document.body.dataset.state = kind;
    $("status").textContent = message;
  }

  // -- sessions ---------------------------------------------------------------------------------------------

  async function connect(note = "") {
    const generation = ++state.generation;
    closeSessions();
    setStatus("connecting", "Connecting…");
    try {
      const made = await Promise.allSettled([
        // the twin is the unadapted model: no steps, and none of the caches that remember the session's text
        api("sessions", {}),
        api("sessions", { adaptation: { lr: 0, cache_weight: 0, copy_model: false, neural_cache: false } })]);
      const failed = made.find((r) => r.status === "rejected");
      if (failed || generation !== state.generation) {
        // not used (one of the two was refused, or a newer connect overtook this one): deleted, not left to expire
        deleteSessions(made.filter((r) => r.status === "fulfilled").map((r) => r.value.id));
        if (failed) throw failed.reason;
        return;
      }
      [state.adapted, state.twin] = made.map((r) => r.value.id);
    } catch (e) {
      if (generation !== state.generation) return;
      setStatus("error", e.status === 401 ? `${e.message}: enter the server's API key above` : e.message);
      if (e.status === 401) keyInput.focus();
      return;
    }
    clearProgress();
    setStatus("ready", `${note}Ready: session ${state.adapted.slice(0, 8)}… and its unadapted twin.`);
    onInput(); // text already there is committed to the new sessions up to its last sentence end
  }

  // The server lost the sessions (or is out of step with them): new ones, which read the text again.
  function sessionsLost(generation) {
    if (generation !== state.generation) return; // an answer about sessions already replaced
    if (performance.now() - state.renewedAt < RENEW_MIN_MS) {
      setStatus("error",
                "The server keeps losing this page's sessions (is its session store full?): Connect tries again.");
      return;
    }
    state.renewedAt = performance.now();
    connect("The server no longer had this page's sessions (expired, evicted, or a restart): "
            + "new ones read the text again. ");
  }

  function deleteSessions(ids) {
    for (const id of ids) {
      if (id) api(`sessions/${id}`, undefined, { method: "DELETE", keepalive: true }).catch(() => {});
    }
  }

  function closeSessions() {
    deleteSessions([state.adapted, state.twin]);
    state.adapted = state.twin = null;
  }

  async function reset() {
    if (!state.adapted) return;
    const generation = ++state.generation; // the commits still queued are dropped (they check the generation)...
    const ids = [state.adapted, state.twin];
    // ...and the one being sent is waited for: the sessions must not read the cleared text after their reset
    const done = state.observing.then(() => Promise.all(ids.map((id) => resetSession(id, generation))));
    text.value = "";
    state.saved = 0;
    clearProgress();
    state.observing = done.catch(() => {}); // the next suggestions and commits come after the reset
    onInput();
    text.focus();
    try {
      await done;
    } catch (e) {
      if (generation !== state.generation) return;
      if (renew(e)) sessionsLost(generation);
      else setStatus("error", `reset: ${e.message}`);
    }
  }

  // A reset, done once: the page no longer counts what the sessions read before it, so one refused as busy past the
  // retries, or without an answer, must not leave a session holding the cleared text. As for a commit (`send`): the
  // page waits for the server, then asks the session what it holds; nothing, the reset was done.
  async function resetSession(id, generation) {
    for (;;) {
      let why;
      try {
        return await withRetry(() => api(`sessions/${id}/reset`));
      } catch (e) {
        if (!(unanswered(e) || busy(e))) throw e;
        why = busy(e) ? `The server is busy (${e.message})` : "The server is not answering";
      }
      const { stats } = await whenAnswered(() => api(`sessions/${id}`, undefined, { method: "GET" }), generation,
                                           `${why}: Reset is done when it is back…`);
      if (stats.bytes_observed + (stats.pending_bytes ?? 0) === 0) return;
    }
  }

  function clearProgress() {
    state.committed = "";
    state.marks = [];
    state.read = {};
    state.observing = Promise.resolve();
    state.requested = null;
    state.series = { adapted: [], static: [], twin: [], chars: [] };
    state.bits = { adapted: 0, static: 0, chars: 0 };
    draw();
  }

  // -- commits ------------------------------------------------------------------------------------------------

  // Where the text the sessions have read ends in the text area as it is now. Text already read cannot be unread:
  // after an edit inside it, the sessions are taken to have read up to the end of the last sentence before the edit
  // (the word at the cursor is then the whole word), and the sentence with the edit is committed again, whole, when
  // the next sentence ends (the sessions read it twice). An edit undone before then (a space deleted and typed
  // again) changes nothing.
  function readUpTo() {
    const value = text.value;
    if (value.startsWith(state.committed)) return state.committed.length;
    let n = 0;
    while (n < state.committed.length && value[n] === state.committed[n]) n++;
    return lastMark(n);
  }

  function lastMark(n) {
    for (let i = state.marks.length - 1; i >= 0; i--) if (state.marks[i] <= n) return state.marks[i];
    return 0;
  }

  function commitSentences() {
    if (!state.adapted) return;
    const base = readUpTo();
    const pending = text.value.slice(base, Math.max(base, text.selectionStart));
    // One commit a sentence (a pasted paragraph too): a point on the chart is a sentence. Blank lines wait for the
    // next sentence.
    const sentences = [];
    let from = 0;
    for (const match of pending.matchAll(BOUNDARY)) {
      const end = match.index + match[0].length;
      if (pending.slice(from, end).trim() === "") continue;
      sentences.push(pending.slice(from, end));
      from = end;
    }
    if (sentences.length === 0) return;
    if (base < state.committed.length) { // an edit inside the committed text: from its sentence on, read again
      state.committed = state.committed.slice(0, base);
      state.marks = state.marks.filter((mark) => mark <= base);
    }
    for (const sentence of sentences) {
      state.committed += sentence;
      state.marks.push(state.committed.length);
      observe(sentence);
    }
  }

  function observe(sentence) {
    const { generation, adapted, twin } = state;
    state.observing = state.observing
      .then(async () => {
        if (generation !== state.generation) return; // reset, or new sessions, since it was committed: not theirs
        // both settled before the next commit (Promise.all would go on at the first failure): a session still
        // sending this one would otherwise read the next first, or take its read bytes for this one's
        const sent = await Promise.allSettled([send(adapted, sentence, generation), send(twin, sentence, generation)]);
        const failed = sent.find((r) => r.status === "rejected");
        if (failed) throw failed.reason;
        const [a, t] = sent.map((r) => r.value);
        if (generation !== state.generation) return;
        const chars = [...sentence].length;
        state.series.adapted.push(a.bits / chars);
        state.series.static.push(a.static_bits / chars);
        state.series.twin.push(t.bits / chars);
        state.series.chars.push(chars);
        state.bits.adapted += a.bits;
        state.bits.static += a.static_bits;
        state.bits.chars += chars;
        updateStats();
        draw();
      })
      .catch((e) => {
        if (generation !== state.generation) return;
        if (renew(e)) sessionsLost(generation);
        else setStatus("error", `observe: ${e.message}`);
      });
  }

  // One session reads one commit, once. Without an answer (the server restarting, a proxy's 502, a connection
  // that broke), the page waits for the server, then asks the session what it has read (docs/operations.md, "When
  // a replica dies"): not the commit, it sends it again; the commit, its bits are the growth of the session's
  // statistics since the answers before it.
  async function send(id, sentence, generation) {
    const read = (state.read[id] ??= { bytes: 0, bits: 0, static_bits: 0 });
    const bytes = encoder.encode(sentence).length;
    const acknowledged = (answer) => {
      read.bytes += bytes;
      read.bits += answer.bits;
      read.static_bits += answer.static_bits;
      return answer;
    };
    for (;;) {
      let why;
      try {
        return acknowledged(await withRetry(() => api(`sessions/${id}/observe`, { text: sentence })));
      } catch (e) {
        if (!(unanswered(e) || busy(e))) throw e; // busy: still so after the retries
        why = busy(e) ? `The server is busy (${e.message})` : "The server is not answering";
      }
      const { stats } = await whenAnswered(() => api(`sessions/${id}`, undefined, { method: "GET" }), generation,
                                           `${why}: the sentence is sent when it is back…`);
      const total = stats.bytes_observed + (stats.pending_bytes ?? 0); // none from a server older than the page
      if (total === read.bytes + bytes) {
        return acknowledged({ bits: stats.bits - read.bits, static_bits: stats.static_bits - read.static_bits });
      }
      if (total !== read.bytes) { // another's text, or a server restored from an older snapshot
        throw new ApiError(409, "the session has not read what this page sent", { code: "out_of_step" });
      }
    }
  }

  // `call` once the server answers again (tried every 0.5 s, then less often, up to 5 s; until the sessions change),
  // the status line saying `why` meanwhile.
  async function whenAnswered(call, generation, why) {
    setStatus("error", why);
    for (let wait = 500; ; wait = Math.min(2 * wait, 5000)) {
      await sleep(wait);
      if (generation !== state.generation) throw new ApiError(0, "the sessions were replaced");
      try {
        return await call();
      } catch (e) {
        if (!(unanswered(e) || busy(e))) throw e;
      }
    }
  }

  // -- suggestions --------------------------------------------------------------------------------------------

  // What the user is typing: the text before the cursor since the sessions' reading ends (they have read the rest;
  // with the cursor in text they have read, since the start of its sentence), at most the API's
  // SUGGEST_MAX_CONTEXT characters (UTF-16 units, so never more code points).
  function currentContext() {
    const before = text.value.slice(0, text.selectionStart);
    const base = readUpTo();
    let context = before.slice(before.length >= base ? base : lastMark(before.length));
    if (context.length > SUGGEST_MAX_CONTEXT) {
      context = context.slice(-SUGGEST_MAX_CONTEXT);
      if (isLowSurrogate(context.charCodeAt(0))) context = context.slice(1);
    }
    return context;
  }

  async function refresh() {
    if (!state.adapted) return;
    const context = currentContext();
    if (context === state.requested) return;
    state.requested = context;
    const seq = ++state.seq;
    // Only the latest keystroke's answer is shown: the request for an older one is abandoned.
    state.controller?.abort();
    const controller = (state.controller = new AbortController());
    // The sessions must have read every commit before the text that follows it is completed.
    await state.observing;
    if (seq !== state.seq) return;
    const { adapted, twin, generation } = state;
    const ask = (id) =>
      api(`sessions/${id}/suggest`, { context, k: K, n_chars: 0 }, { signal: controller.signal });
    const started = performance.now();
    try {
      const [a, t] = await Promise.all([ask(adapted), compare.checked ? ask(twin) : null]);
      if (seq !== state.seq) return;
      const words = a.completions.map((w) => w.text);
      const wordsStatic = t ? t.completions.map((w) => w.text) : [];
      // After a mark ("Hi,") a word may be the next one after a space the keyboard inserts: `space_before`.
      const spaced = a.completions.map((w) => w.space_before === true);
      const spacedStatic = t ? t.completions.map((w) => w.space_before === true) : [];
      state.shown = { context, prefix: a.prefix, words, spaced, wordsStatic, spacedStatic,
                      ms: performance.now() - started };
      render(bar, a.completions, true);
      render(barStatic, t ? t.completions : [], false);
      if (document.body.dataset.state !== "ready") setStatus("ready", "Ready.");
    } catch (e) {
      if (e.name === "AbortError" || seq !== state.seq) return;
      state.requested = null; // the next keystroke asks again
      // An older keystroke's suggestions cannot be accepted: shown, they would keep Tab from leaving the text box.
      state.shown = null;
      render(bar, [], true);
      render(barStatic, [], false);
      if (renew(e)) sessionsLost(generation);
      else setStatus("error", `suggest: ${e.message}`);
    }
  }

  function render(el, completions, keys) {
    el.querySelectorAll("button.word").forEach((button, i) => {
      const word = completions[i];
      button.disabled = !word;
      button.textContent = word ? word.text : "";
      button.dataset.word = word ? word.text : "";
      button.dataset.space = word && word.space_before ? "1" : "";
      button.title = word ? `p = ${word.prob.toPrecision(2)}${word.space_before ? ", after a space" : ""}` : "";
      if (keys) button.dataset.key = i === 0 ? "Tab" : `Alt+${i + 1}`;
    });
    el.dataset.count = String(completions.length);
  }

  // The suggestion replaces the typed part of the word and adds a space (or steps over the one already there). A word
  // offered after a mark with `space_before` ("Hi," then "there") is inserted after a space: " there ".
  function accept(word, spaced = false) {
    const shown = state.shown;
    const context = currentContext();
    if (!shown || !context.startsWith(shown.context)) return false;
    // The bar may be a keystroke or two behind (Tab pressed before the last letter's answer came back): its word
    // still fits if what was typed since goes on with the same word and the word goes on with it (after the space,
    // for a word offered after one: the space typed since is the one the word needed).
    let typed = context.slice(shown.context.length);
    let space = "";
    if (spaced && typed.startsWith(" ")) typed = typed.slice(1);
    else if (spaced && typed === "") space = " ";
    else if (spaced) return false; // a letter typed right after the mark: the word does not follow a space
    if (WORD_REST.exec(typed)[0] !== typed) return false;
    const prefix = shown.prefix + typed;
    if (!word.startsWith(prefix)) return false;
    const start = text.selectionStart;
    const from = start - prefix.length;
    let end = text.selectionEnd;
    // The cursor inside a word (a typo being fixed): the suggestion replaces the whole word, its rest too.
    if (end === start) end += WORD_REST.exec(text.value.slice(end))[0].length;
    const spaceFollows = text.value[end] === " ";
    text.setRangeText(spaceFollows ? space + word : `${space}${word} `, from, end, "end");
    if (spaceFollows) text.selectionStart = text.selectionEnd = text.selectionEnd + 1;
    // Saved: the space before it if the keyboard put it there, the rest of the word and the space after, less the
    // one key that accepted it.
    state.saved += space.length + [...word].length - [...prefix].length;
    onInput();
    return true;
  }

  // -- statistics and chart -----------------------------------------------------------------------------------

  function updateStats() {
    const total = [...text.value].length;
    const bpc = (bits) => (state.bits.chars ? `${(bits / state.bits.chars).toFixed(2)} bpc` : "–");
    $("saved").textContent = String(state.saved);
    $("ksr").textContent = `${(total ? (100 * state.saved) / total : 0).toFixed(1)}%`;
    $("commits").textContent = String(state.series.adapted.length);
    $("bpc-adapted").textContent = bpc(state.bits.adapted);
    $("bpc-static").textContent = bpc(state.bits.static);
    $("gain").textContent = state.bits.static ? `${(100 * (1 - state.bits.adapted / state.bits.static)).toFixed(1)}%` : "–";
  }

  function draw() {
    const { adapted, static: fixed } = state.series;
    const n = adapted.length;
    chart.dataset.points = String(n);
    const ratio = window.devicePixelRatio || 1;
    const width = chart.clientWidth || chart.width;
    const height = chart.clientHeight || chart.height;
    chart.width = Math.round(width * ratio);
    chart.height = Math.round(height * ratio);
    const g = chart.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const css = getComputedStyle(document.documentElement);
    const color = (name) => css.getPropertyValue(name).trim();
    const pad = { left: 46, right: 14, top: 12, bottom: 24 };
    const w = width - pad.left - pad.right;
    const h = height - pad.top - pad.bottom;
    // The y range hugs the data (whole bits at its ends): the gap between the lines is what matters.
    const low = n ? Math.floor(Math.min(...adapted, ...fixed)) : 0;
    const high = n ? Math.max(low + 1, Math.ceil(Math.max(...adapted, ...fixed))) : 8;
    const x = (i) => pad.left + (n === 1 ? w / 2 : (i * w) / (n - 1));
    const y = (v) => pad.top + h - ((v - low) / (high - low)) * h;

    g.font = "11px system-ui, sans-serif";
    g.textBaseline = "middle";
    g.lineWidth = 1;
    const ticks = high - low <= 2 ? 4 * (high - low) : high - low;
    for (let i = 0; i <= ticks; i++) {
      const v = low + ((high - low) * i) / ticks;
      g.strokeStyle = color("--line");
      g.beginPath();
      g.moveTo(pad.left, Math.round(y(v)) + 0.5);
      g.lineTo(pad.left + w, Math.round(y(v)) + 0.5);
      g.stroke();
      g.fillStyle = color("--muted");
      g.textAlign = "right";
      g.fillText(v.toFixed(2), pad.left - 6, y(v));
    }
    g.textAlign = "center";
    if (n > 1) {
      g.fillText("1", x(0), height - 8);
      g.fillText(String(n), x(n - 1), height - 8);
    }
    g.fillText("bits per character, by commit", pad.left + w / 2, height - 8);
    if (n === 0) {
      g.fillText("commit a sentence (Enter, or . ! ? and a space)", pad.left + w / 2, pad.top + h / 2);
      return;
    }
    for (const [values, name] of [[fixed, "--static"], [adapted, "--adapted"]]) {
      g.strokeStyle = g.fillStyle = color(name);
      g.lineWidth = 2;
      g.beginPath();
      values.forEach((v, i) => (i ? g.lineTo(x(i), y(v)) : g.moveTo(x(i), y(v))));
      g.stroke();
      values.forEach((v, i) => {
        g.beginPath();
        g.arc(x(i), y(v), 3, 0, 2 * Math.PI);
        g.fill();
      });
    }
  }

  // -- events -------------------------------------------------------------------------------------------------

  function onInput() {
    commitSentences();
    updateStats();
    refresh();
  }

  text.addEventListener("input", (event) => {
    if (!event.isComposing) onInput();
  });
  text.addEventListener("compositionend", onInput);
  // The cursor moved without typing: the word at the cursor changed.
  text.addEventListener("click", refresh);
  text.addEventListener("keyup", (event) => {
    if (event.key.startsWith("Arrow") || event.key === "Home" || event.key === "End") refresh();
  });
  text.addEventListener("keydown", (event) => {
    if (event.isComposing || event.ctrlKey || event.metaKey) return;
    let rank = -1;
    if (event.key === "Tab" && !event.shiftKey && !event.altKey) rank = 0;
    // Alt: plain digits must stay typeable. event.code: Alt+digit types another character on some layouts.
    else if (event.altKey && /^Digit[1-3]$/.test(event.code)) rank = Number(event.code.slice(5)) - 1;
    if (rank < 0) return;
    const word = state.shown?.words[rank];
    if (word === undefined) return;
    event.preventDefault(); // even when the bar is a keystroke behind: Tab here means "accept", not "leave"
    accept(word, state.shown.spaced[rank]);
  });
  for (const el of [bar, barStatic]) {
    el.addEventListener("mousedown", (event) => event.preventDefault()); // keep the focus (and cursor) in the text
    el.addEventListener("click", (event) => {
      const button = event.target.closest("button.word");
      if (button && !button.disabled) accept(button.dataset.word, button.dataset.space === "1");
      text.focus();
    });
  }
  compare.addEventListener("change", () => {
    barStatic.hidden = !compare.checked;
    state.requested = null;
    refresh();
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = keyInput.value.trim();
    connect();
  });
  $("reset").addEventListener("click", reset);
  window.addEventListener("resize", draw);
  window.addEventListener("pagehide", () => {
    state.generation++; // what is still under way for these sessions stops
    closeSessions();
  });
  window.addEventListener("pageshow", (event) => {
    if (event.persisted) connect(); // back from the page cache: its sessions were closed on leaving
  });

  function isLowSurrogate(code) {
    return code >= 0xdc00 && code <= 0xdfff;
  }

  // For tests and the curious: a copy of what the page holds.
  window.adaptlmKeyboard = {
    snapshot: () =>
      structuredClone({
        sessions: { adapted: state.adapted, twin: state.twin },
        committed: state.committed,
        context: currentContext(),
        shown: state.shown,
        saved: state.saved,
        series: state.series,
      }),
  };

  keyInput.value = state.key;
  // A key given as ?key= leaves the address bar, so that it is not kept in the history, bookmarked or shared.
  if (new URLSearchParams(location.search).has("key")) history.replaceState(null, "", location.pathname);
  connect();
})();
