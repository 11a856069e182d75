// Tiny DOM helpers: every text goes in as a text node (never as HTML), so recorded data cannot inject markup.

/** An element: h("a", {href: "#/x", class: "btn", onclick: fn}, "text", child, ...). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key in el && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replace the content of ``el`` with ``children``. */
export function mount(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** A date-time as "2026-11-23 07:34:17" (UTC), or "" when absent. */
export function when(value) {
  if (!value) return "";
  const moment = new Date(value);
  return isNaN(moment) ? String(value) : moment.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

/** Milliseconds as m:ss.mmm. */
export function clock(ms) {
  const total = Math.max(0, Math.round(ms));
  const minutes = Math.floor(total / 60000);
  const seconds = ((total % 60000) / 1000).toFixed(3).padStart(6, "0");
  return `${minutes}:${seconds}`;
}

/** A message line: kind is "error", "ok" or "info". */
export function notice(text, kind = "info") {
  return h("p", {class: `notice ${kind}`, role: kind === "error" ? "alert" : "status"}, text);
}

/** A <select> of options [value, label]. */
export function select(name, options, value, attrs = {}) {
  return h("select", {name, ...attrs},
    options.map(([v, label]) => h("option", {value: v, selected: v === value}, label)));
}

/** A labelled form field. */
export function field(label, control) {
  return h("label", {class: "field"}, h("span", {}, label), control);
}

/** Decode base64 to text (UTF-8, lenient). */
export function fromBase64(data) {
  const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
  return new TextDecoder("utf-8", {fatal: false}).decode(bytes);
}
