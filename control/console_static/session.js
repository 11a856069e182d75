// One session: what it was, a kill button while it is live, and its recording in the form of its protocol.
import {api} from "./api.js";
import {h, mount, when, clock, notice, select, fromBase64} from "./dom.js";
import {statusBadge} from "./sessions.js";

const SPEEDS = [["0.5", "0.5×"], ["1", "1×"], ["2", "2×"], ["4", "4×"], ["8", "8×"]];

export async function sessionView({me, main}, id) {
  const session = await api("GET", `/sessions/${encodeURIComponent(id)}`);
  const live = session.status !== "done";
  const messages = h("div", {class: "messages"});
  const mayKill = live && (me.is_admin || session.user_id === me.subject);
  const kill = mayKill ? h("button", {type: "button", class: "danger", id: "kill", onclick: async () => {
    if (!confirm(`End session ${session.id} of ${session.user}?`)) return;
    try {
      await api("POST", `/sessions/${encodeURIComponent(session.id)}/kill`);
      mount(messages, notice("Session killed.", "ok"));
      kill.disabled = true;
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  }}, "Kill session") : null;
  const facts = [["Id", session.id], ["User", session.user], ["Connection", session.connection],
    ["Protocol", session.connection_subtype || session.type], ["Verb", session.verb],
    ["Started", when(session.start_date)], ["Ended", when(session.end_date)],
    ["Exit code", session.exit_code ?? ""], ["Review", session.review ? session.review.status : ""]];
  const recording = h("section", {id: "recording"}, h("p", {class: "muted"}, "Loading the recording…"));
  mount(main,
    h("p", {}, h("a", {href: "#/sessions"}, "← Sessions")),
    h("h1", {}, `Session ${session.connection}`, " ", statusBadge(session)),
    h("dl", {class: "facts"}, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v))])),
    session.script && session.script.data ? [h("h2", {}, "Script"), h("pre", {class: "code"}, session.script.data)]
      : null,
    kill, messages, recording);
  const render = {ssh: sshPlayer, postgres: statementTable, mysql: statementTable, rdp: framePlayer,
    httpproxy: exchanges}
    [session.connection_subtype] || plainOutput;
  try {
    await render(recording, session);
  } catch (err) {
    mount(recording, notice(err.message, "error"));
  }
}

// ------------------------------------------------------------------ SSH: asciinema-player

async function sshPlayer(el, session) {
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
      speed: parseFloat(speed.value), startAt, preload: true, controls: false, fit: "width", idleTimeLimit: 5,
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

// ------------------------------------------------------------------ PostgreSQL: statements, searchable

async function statementTable(el, session) {
  const doc = await api("GET", `/sessions/${encodeURIComponent(session.id)}`, {query: {format: "json"}});
  const rows = doc.statements;
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
    h("table", {class: "grid statements", id: "statements"},
      h("thead", {}, h("tr", {}, ["At", "Statement", "Result", "Error"].map((t) => h("th", {}, t)))), body),
    h("div", {class: "pager"}, prev, info, next));
}

// ------------------------------------------------------------------ HTTP: the exchanges

async function exchanges(el, session) {
  const full = await api("GET", `/sessions/${encodeURIComponent(session.id)}`, {query: {expand: "event_stream"}});
  const list = [];
  for (const [offset, kind, data] of full.event_stream || []) {
    const text = fromBase64(data);
    if (kind === "i" || !list.length) list.push({offset, request: "", response: "", error: ""});
    const last = list[list.length - 1];
    if (kind === "i") last.request += text;
    else if (kind === "o") last.response += text;
    else last.error += text;
  }
  const firstLine = (text) => text.split(/\r?\n/, 1)[0];
  mount(el, h("h2", {}, `Exchanges (${list.length})`), h("ol", {class: "exchanges", id: "exchanges"},
    list.map((x) => h("li", {}, h("details", {},
      h("summary", {}, h("span", {class: "mono"}, clock(x.offset)), " ", firstLine(x.request) || "(no request)",
        " → ", firstLine(x.response) || firstLine(x.error) || "(no response)"),
      h("h3", {}, "Request"), h("pre", {class: "code"}, x.request),
      h("h3", {}, "Response"), h("pre", {class: "code"}, x.response),
      x.error ? [h("h3", {}, "Error"), h("pre", {class: "code error"}, x.error)] : null)))));
}

// ------------------------------------------------------------------ RDP: a frame player over the composed PNGs

async function framePlayer(el, session) {
  const base = `/sessions/${encodeURIComponent(session.id)}/rdp-frames`;
  const frames = [];
  let total = 0;
  for (let offset = 0; ; offset += 200) {
    const page = await api("GET", base, {query: {offset, limit: 200}});
    total = page.total_frames;
    for (const f of page.frames) frames.push({index: f.index, timestamp: f.timestamp});
    if (!page.has_more || !page.frames.length) break;
  }
  if (!total) return mount(el, h("h2", {}, "Screen"), notice("No frame was recorded.", "info"));
  const image = h("img", {id: "frame", alt: "the remote screen", class: "screen"});
  const seek = h("input", {type: "range", id: "frame-seek", min: "0", max: String(frames.length - 1), value: "0"});
  const label = h("span", {id: "frame-info", class: "mono"});
  const playButton = h("button", {type: "button", id: "frame-play"}, "Play");
  const speed = select("speed", SPEEDS, "1", {id: "frame-speed"});
  let at = 0;
  let timer = null;
  let url = null;
  let shown = -1;
  async function show(i) {
    at = i;
    seek.value = String(i);
    label.textContent = `frame ${i + 1} of ${frames.length} at ${clock(frames[i].timestamp)}`;
    const {body} = await api("GET", `${base}/${frames[i].index}.png`, {as: "blob"});
    if (at !== i) return;  // a later frame was asked for meanwhile
    if (url) URL.revokeObjectURL(url);
    url = URL.createObjectURL(body);
    image.src = url;
    shown = i;
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
      await show(at + 1);
      if (timer) step();
    }, Math.max(0, Math.min(wait, 5000)));
  }
  playButton.addEventListener("click", () => {
    if (timer) return stop();
    if (at >= frames.length - 1) at = 0;
    playButton.textContent = "Pause";
    timer = -1;
    show(at).then(step);
  });
  seek.addEventListener("input", () => show(parseInt(seek.value, 10)));
  window.addEventListener("hashchange", stop, {once: true});
  mount(el, h("h2", {}, "Screen"),
    h("div", {class: "controls"}, playButton, h("label", {}, "Speed ", speed), seek, label,
      h("button", {type: "button", id: "frame-next", onclick: () => at < frames.length - 1 && show(at + 1)}, "Step →")),
    image);
  await show(0);
  return shown;
}

// ------------------------------------------------------------------ anything else: the output as text

async function plainOutput(el, session) {
  const doc = await api("GET", `/sessions/${encodeURIComponent(session.id)}`, {query: {event_stream: "utf8"}});
  mount(el, h("h2", {}, "Output"), h("pre", {class: "code", id: "output"}, (doc.event_stream || [""])[0]));
}
