// One session: what it was, a kill button while it is live, and its recording in the form of its protocol.
// A session still running is followed as it happens (GET /sessions/{id}/stream): its terminal, statements,
// exchanges or screen grow as they are recorded, and its end shows at once. Nothing here sends input to it.
import {api, follow, protocols} from "./api.js";
import {h, mount, when, clock, notice, select, fromBase64} from "./dom.js";
import {statusBadge} from "./sessions.js";

const SPEEDS = [["0.5", "0.5×"], ["1", "1×"], ["2", "2×"], ["4", "4×"], ["8", "8×"]];

export async function sessionView({me, main}, id) {
  let session = await api("GET", `/sessions/${encodeURIComponent(id)}`);
  const messages = h("div", {class: "messages"});
  const badge = h("span", {id: "session-status"}, statusBadge(session));
  const facts = h("dl", {class: "facts"});
  const mayKill = (s) => s.status !== "done" && (me.is_admin || s.user_id === me.subject);
  const kill = h("button", {type: "button", class: "danger", id: "kill", hidden: !mayKill(session), onclick: async () => {
    if (!confirm(`End session ${session.id} of ${session.user}?`)) return;
    try {
      await api("POST", `/sessions/${encodeURIComponent(session.id)}/kill`);
      mount(messages, notice("Session killed.", "ok"));
      kill.disabled = true;
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  }}, "Kill session");
  function show(s) {
    session = s;
    mount(badge, statusBadge(s));
    mount(facts, [["Id", s.id], ["User", s.user], ["Connection", s.connection],
      ["Protocol", s.connection_subtype || s.type], ["Verb", s.verb], ["Started", when(s.start_date)],
      ["Ended", when(s.end_date)], ["Exit code", s.exit_code ?? ""], ["Review", s.review ? s.review.status : ""]]
      .map(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v))]));
    kill.hidden = !mayKill(s);
  }
  show(session);
  const recording = h("section", {id: "recording"}, h("p", {class: "muted"}, "Loading the recording…"));
  mount(main,
    h("p", {}, h("a", {href: "#/sessions"}, "← Sessions")),
    h("h1", {}, `Session ${session.connection}`, " ", badge),
    facts,
    session.script && session.script.data ? [h("h2", {}, "Script"), h("pre", {class: "code"}, session.script.data)]
      : null,
    kill, messages, recording);
  const live = session.status !== "done";
  const kinds = live ? LIVE : RECORDED;
  let view;
  try {
    // the view its protocol's presentation says: statements, a terminal, frames, exchanges or text
    const protocol = (await protocols()).get(session.connection_subtype);
    const render = kinds[protocol ? protocol.presentation : "text"] || kinds.text;
    view = await render(recording, session);
  } catch (err) {
    return mount(recording, notice(err.message, "error"));
  }
  if (!live) return;
  // follow it until it ends or the page is left
  const stop = new AbortController();
  window.addEventListener("hashchange", () => stop.abort(), {once: true});
  const watching = h("span", {class: "badge live", id: "following"}, "● following live");
  recording.prepend(watching);
  try {
    await follow(`/sessions/${encodeURIComponent(session.id)}/stream`, (name, data) => {
      if (name === "event") view.event(data);
      else if (name === "frames") view.frames && view.frames(data.total_frames);
      else if (name === "session") show(data);
      else if (name === "end") {
        show(data);
        view.end && view.end();
        watching.remove();
        // beside, not over, what a kill from this page said
        messages.append(notice(`Session ended${data.exit_code != null ? ` (exit code ${data.exit_code})` : ""}.`,
          data.exit_code ? "info" : "ok"));
        kill.hidden = true;
      }
    }, {signal: stop.signal});
  } catch (err) {
    watching.remove();
    mount(messages, notice(err.message, "error"));
  }
}

// ------------------------------------------------------------------ a terminal (SSH): asciinema-player

async function terminalPlayer(el, session) {
  const cast = await api("GET", `/sessions/${encodeURIComponent(session.id)}`, {query: {event_stream: "asciicast"}});
  if (!window.AsciinemaPlayer) throw new Error("the terminal player is missing: build the console (make console)");
  const screen = h("div", {id: "terminal", class: "terminal"});
  const playButton = h("button", {type: "button", id: "play"}, "Play");
  const speed = select("speed", SPEEDS, "1", {id: "speed"});
  const seek = h("input", {type: "range", id: "seek", min: "0", max: "0", step: "any", value: "0"});
  const time = h("span", {id: "time", class: "mono"}, "0:00.000");
  let player = null;
  let playing = false;
  let timer = null;

  function create(startAt) {
    if (player) player.dispose();
    player = AsciinemaPlayer.create({data: cast}, screen, {
      speed: parseFloat(speed.value), startAt, preload: true, controls: false, fit: "both", idleTimeLimit: 5,
      terminalFontFamily: "monospace",
    });
    player.addEventListener("play", () => { playing = true; playButton.textContent = "Pause"; });
    player.addEventListener("playing", () => { playing = true; playButton.textContent = "Pause"; });
    player.addEventListener("pause", () => { playing = false; playButton.textContent = "Play"; });
    player.addEventListener("ended", () => { playing = false; playButton.textContent = "Play"; });
  }
  function tick() {
    if (!player) return;
    Promise.resolve(player.getCurrentTime()).then((t) => {
      if (typeof t === "number") {
        if (document.activeElement !== seek) seek.value = String(t);
        time.textContent = clock(t * 1000);
      }
    });
    Promise.resolve(player.getDuration()).then((d) => { if (typeof d === "number") seek.max = String(d); });
  }
  create(0);
  timer = setInterval(tick, 200);
  window.addEventListener("hashchange", () => clearInterval(timer), {once: true});
  playButton.addEventListener("click", () => (playing ? player.pause() : player.play()));
  seek.addEventListener("input", async () => {
    await player.seek(parseFloat(seek.value));
    time.textContent = clock(parseFloat(seek.value) * 1000);
  });
  speed.addEventListener("change", async () => {
    const at = (await player.getCurrentTime()) || 0;
    const was = playing;
    create(at);
    if (was) player.play();
  });
  mount(el, h("h2", {}, "Terminal replay"),
    h("div", {class: "controls"}, playButton, h("label", {}, "Speed ", speed), seek, time),
    screen);
}

/** A running SSH session's terminal: the player fed by the stream (its history first, then live); no keyboard. */
async function liveTerminal(el, session) {
  if (!window.AsciinemaPlayer) throw new Error("the terminal player is missing: build the console (make console)");
  const screen = h("div", {id: "terminal", class: "terminal live"});
  const terminal = (session.metrics || {}).terminal;
  const pty = terminal && typeof terminal === "object";
  const size = {cols: (pty && terminal.width) || 80, rows: (pty && terminal.height) || 24};
  const decoder = new TextDecoder("utf-8");
  const waiting = [];
  let dispatch = null;
  const started = performance.now();
  const driver = (callbacks) => ({
    play() {
      callbacks.dispatch("play");
      callbacks.dispatch("reset", {size});
      callbacks.dispatch("playing");
      dispatch = callbacks.dispatch;
      for (const text of waiting.splice(0)) dispatch("output", text);
      return true;
    },
    stop() {},
    getTiming: () => ({time: (performance.now() - started) / 1000, rate: 1,
      sampledAt: performance.timeOrigin + performance.now()}),
  });
  AsciinemaPlayer.create(driver, screen, {autoPlay: true, controls: false, fit: "both",
    terminalFontFamily: "monospace"});
  function write(text) {
    if (dispatch) dispatch("output", text);
    else waiting.push(text);
  }
  mount(el, h("h2", {}, "Terminal (live)"), screen);
  return {
    event(e) {
      if (e.type === "i") return;
      let text = decoder.decode(Uint8Array.from(atob(e.payload), (c) => c.charCodeAt(0)), {stream: true});
      if (!pty) text = text.replace(/\r?\n/g, "\r\n");
      if (e.type === "e" && !text.endsWith("\n")) text = `\r\n${text}\r\n`;
      write(text);
    },
  };
}

// ------------------------------------------------------------------ PostgreSQL: statements, searchable

/** The statements table over ``rows`` ({offset_ms, statement, output, error}); ``add`` takes a live event. */
function statements(el, rows) {
  const PAGE = 25;
  let page = 0;
  const search = h("input", {type: "search", id: "statement-search", placeholder: "Search statements, results, errors"});
  const body = h("tbody");
  const info = h("span", {id: "statement-info"});
  const prev = h("button", {type: "button", id: "statement-prev", onclick: () => { page--; draw(); }}, "← Previous");
  const next = h("button", {type: "button", id: "statement-next", onclick: () => { page++; draw(); }}, "Next →");
  function matching() {
    const needle = search.value.trim().toLowerCase();
    if (!needle) return rows;
    return rows.filter((r) => `${r.statement}\n${r.output}\n${r.error}`.toLowerCase().includes(needle));
  }
  function draw() {
    const found = matching();
    const pages = Math.max(1, Math.ceil(found.length / PAGE));
    page = Math.min(Math.max(0, page), pages - 1);
    const shown = found.slice(page * PAGE, (page + 1) * PAGE);
    mount(body, shown.length ? shown.map((r) => h("tr", {class: r.error ? "failed" : ""},
      h("td", {class: "mono"}, clock(r.offset_ms)),
      h("td", {}, h("pre", {class: "code"}, r.statement)),
      h("td", {}, h("pre", {class: "code"}, r.output)),
      h("td", {}, r.error ? h("pre", {class: "code error"}, r.error) : ""))) :
      h("tr", {}, h("td", {colspan: 4, class: "muted"}, "No statement matches.")));
    info.textContent = found.length
      ? `statements ${page * PAGE + 1}–${page * PAGE + shown.length} of ${found.length}` +
        (found.length !== rows.length ? ` (${rows.length} in all)` : "")
      : "no statements";
    prev.disabled = page === 0;
    next.disabled = page >= pages - 1;
  }
  search.addEventListener("input", () => { page = 0; draw(); });
  draw();
  mount(el, h("h2", {}, "Statements"), h("div", {class: "controls"}, search),
    h("div", {class: "scroll"}, h("table", {class: "grid statements", id: "statements"},
      h("thead", {}, h("tr", {}, ["At", "Statement", "Result", "Error"].map((t) => h("th", {}, t)))), body)),
    h("div", {class: "pager"}, prev, info, next));
  return {
    event(e) {
      const text = fromBase64(e.payload);
      if (e.type === "i" || !rows.length) {
        rows.push({offset_ms: e.offset_ms, statement: e.type === "i" ? text : "", output: "", error: ""});
        if (e.type === "i") return draw();
      }
      const last = rows[rows.length - 1];
      if (e.type === "o") last.output += text;
      else last.error += (last.error ? "\n" : "") + text;
      draw();
    },
  };
}

async function statementTable(el, session) {
  const doc = await api("GET", `/sessions/${encodeURIComponent(session.id)}`, {query: {format: "json"}});
  return statements(el, doc.statements);
}

// ------------------------------------------------------------------ HTTP: the exchanges

function exchangeList(el, events) {
  const list = [];
  const ol = h("ol", {class: "exchanges", id: "exchanges"});
  const title = h("h2", {});
  const firstLine = (text) => text.split(/\r?\n/, 1)[0];
  function item(x) {
    return h("li", {}, h("details", {},
      h("summary", {}, h("span", {class: "mono"}, clock(x.offset)), " ", firstLine(x.request) || "(no request)",
        " → ", firstLine(x.response) || firstLine(x.error) || "(no response)"),
      h("h3", {}, "Request"), h("pre", {class: "code"}, x.request),
      h("h3", {}, "Response"), h("pre", {class: "code"}, x.response),
      x.error ? [h("h3", {}, "Error"), h("pre", {class: "code error"}, x.error)] : null));
  }
  function add(offset, kind, text) {
    if (kind === "i" || !list.length) list.push({offset, request: "", response: "", error: "", el: null});
    const last = list[list.length - 1];
    if (kind === "i") last.request += text;
    else if (kind === "o") last.response += text;
    else last.error += text;
    const fresh = item(last);
    if (last.el) last.el.replaceWith(fresh);
    else ol.append(fresh);
    last.el = fresh;
    title.textContent = `Exchanges (${list.length})`;
  }
  for (const [offset, kind, data] of events) add(offset, kind, fromBase64(data));
  title.textContent = `Exchanges (${list.length})`;
  mount(el, title, ol);
  return {event(e) { add(e.offset_ms, e.type, fromBase64(e.payload)); }};
}

async function exchanges(el, session) {
  const full = await api("GET", `/sessions/${encodeURIComponent(session.id)}`, {query: {expand: "event_stream"}});
  return exchangeList(el, full.event_stream || []);
}

// ------------------------------------------------------------------ RDP: a frame player over the composed PNGs

async function framePlayer(el, session, live = false) {
  const base = `/sessions/${encodeURIComponent(session.id)}/rdp-frames`;
  const frames = [];
  async function load() {  // the frames not listed yet
    for (let offset = frames.length; ; offset += 200) {
      const page = await api("GET", base, {query: {offset, limit: 200}});
      for (const f of page.frames) if (f.index >= frames.length) frames.push({index: f.index, timestamp: f.timestamp});
      if (!page.has_more || !page.frames.length) return page.total_frames;
    }
  }
  const total = await load();
  const image = h("img", {id: "frame", alt: "the remote screen", class: "screen"});
  const seek = h("input", {type: "range", id: "frame-seek", min: "0", max: String(Math.max(frames.length - 1, 0)),
    value: "0"});
  const label = h("span", {id: "frame-info", class: "mono"});
  const playButton = h("button", {type: "button", id: "frame-play"}, "Play");
  const speed = select("speed", SPEEDS, "1", {id: "frame-speed"});
  let at = 0;
  let timer = null;
  let url = null;
  let atEnd = live;  // live: show each new frame as it comes, until the person moves back
  async function showFrame(i) {
    at = i;
    seek.value = String(i);
    label.textContent = `frame ${i + 1} of ${frames.length} at ${clock(frames[i].timestamp)}`;
    const {body} = await api("GET", `${base}/${frames[i].index}.png`, {as: "blob"});
    if (at !== i) return;  // a later frame was asked for meanwhile
    if (url) URL.revokeObjectURL(url);
    url = URL.createObjectURL(body);
    image.src = url;
    image.dataset.frame = String(i);
  }
  function stop() {
    clearTimeout(timer);
    timer = null;
    playButton.textContent = "Play";
  }
  function step() {
    if (at >= frames.length - 1) return stop();
    const wait = (frames[at + 1].timestamp - frames[at].timestamp) / parseFloat(speed.value);
    timer = setTimeout(async () => {
      await showFrame(at + 1);
      if (timer) step();
    }, Math.max(0, Math.min(wait, 5000)));
  }
  playButton.addEventListener("click", () => {
    if (timer) return stop();
    if (at >= frames.length - 1) at = 0;
    playButton.textContent = "Pause";
    timer = -1;
    showFrame(at).then(step);
  });
  seek.addEventListener("input", () => {
    atEnd = live && parseInt(seek.value, 10) >= frames.length - 1;
    showFrame(parseInt(seek.value, 10));
  });
  window.addEventListener("hashchange", stop, {once: true});
  mount(el, h("h2", {}, live ? "Screen (live)" : "Screen"),
    h("div", {class: "controls"}, playButton, h("label", {}, "Speed ", speed), seek, label,
      h("button", {type: "button", id: "frame-next", onclick: () => at < frames.length - 1 && showFrame(at + 1)},
        "Step →")),
    image);
  const empty = notice("No frame was recorded yet.", "info");
  if (!total) el.append(empty);
  else await showFrame(live ? frames.length - 1 : 0);
  let loading = null;
  return {
    event() {},
    frames(count) {  // more frames were recorded: list them, and show the newest when following the end
      if (count <= frames.length || loading) return;
      loading = load().then(() => {
        loading = null;
        empty.remove();
        seek.max = String(frames.length - 1);
        if (atEnd && !timer) return showFrame(frames.length - 1);
        label.textContent = `frame ${at + 1} of ${frames.length} at ${clock(frames[at].timestamp)}`;
      });
    },
  };
}

// ------------------------------------------------------------------ anything else: the output as text

async function plainOutput(el, session) {
  const doc = await api("GET", `/sessions/${encodeURIComponent(session.id)}`, {query: {event_stream: "utf8"}});
  const out = h("pre", {class: "code", id: "output"}, (doc.event_stream || [""])[0]);
  mount(el, h("h2", {}, "Output"), out);
  return out;
}

// by presentation (GET /api/protocols says each protocol's)
const RECORDED = {terminal: terminalPlayer, statements: statementTable, frames: framePlayer, exchanges: exchanges,
  text: plainOutput};

// a live session starts empty: the stream sends its history first, then what comes
const LIVE = {
  terminal: liveTerminal,
  statements: async (el) => statements(el, []),
  exchanges: async (el) => exchangeList(el, []),
  frames: (el, session) => framePlayer(el, session, true),
  text: async (el) => {
    const out = h("pre", {class: "code", id: "output"});
    mount(el, h("h2", {}, "Output (live)"), out);
    return {event(e) { if (e.type !== "i") out.textContent += fromBase64(e.payload); }};
  },
};
