// The console's shell: sign-in, navigation, and the hash router (#/sessions, #/sessions/ID, #/reviews, ...).
import {api, auth, whenSignedOut} from "./api.js";
import {h, mount, notice, field} from "./dom.js";
import {sessionsView} from "./sessions.js";
import {sessionView} from "./session.js";
import {reviewsView} from "./reviews.js";
import {connectionsView} from "./connections.js";
import {guardrailsView, guardrailEditView} from "./guardrails.js";
import {auditView} from "./audit.js";
import {runbooksView, runbookRunView} from "./runbooks.js";
import {reportsView} from "./reports.js";
import {settingsView} from "./settings.js";

const main = document.getElementById("main");
const state = {me: null};

const ROUTES = [
  [/^\/sessions\/([^/]+)$/, (ctx, id) => sessionView(ctx, decodeURIComponent(id))],
  [/^\/sessions$/, (ctx) => sessionsView(ctx)],
  [/^\/reviews$/, (ctx) => reviewsView(ctx)],
  [/^\/connections$/, (ctx) => connectionsView(ctx)],
  [/^\/guardrails\/new$/, (ctx) => guardrailEditView(ctx, null)],
  [/^\/guardrails\/([^/]+)$/, (ctx, id) => guardrailEditView(ctx, decodeURIComponent(id))],
  [/^\/guardrails$/, (ctx) => guardrailsView(ctx)],
  [/^\/audit$/, (ctx) => auditView(ctx)],
  [/^\/runbooks\/run$/, (ctx) => runbookRunView(ctx)],
  [/^\/runbooks$/, (ctx) => runbooksView(ctx)],
  [/^\/reports$/, (ctx) => reportsView(ctx)],
  [/^\/settings$/, (ctx) => settingsView(ctx)],
];

/** The current route: path and query of the hash (#/sessions?connection=pg). */
function current() {
  const raw = location.hash.replace(/^#/, "") || "/sessions";
  const [path, query = ""] = raw.split("?");
  return {path, params: new URLSearchParams(query)};
}

/** Go to ``path`` with ``params`` (empty values left out). */
export function go(path, params = {}) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) if (value !== "" && value != null) query.set(key, value);
  const text = query.toString();
  location.hash = `#${path}${text ? `?${text}` : ""}`;
}

function signOut(message) {
  clearInterval(idle.timer);
  auth.token = null;
  state.me = null;
  renderSignIn(message);
}

whenSignedOut(() => signOut("Your sign-in expired or was revoked: sign in again."));

/** Sign out: the gateway refuses the token from now on (a copy of it included), then the page forgets it. */
async function signOutHere() {
  let message = "Signed out.";
  try {
    await api("POST", "/logout");
  } catch (err) {
    if (err.status !== 401) message = `Signed out of this page; the gateway could not be told (${err.message}).`;
  }
  signOut(message);
}

/** Idle sign-out: the token lasts ``idle`` seconds and is renewed while the page is used (a key, a click, a
 * scroll); after ``idle`` seconds without one the page signs out. The gateway refuses the token by itself then. */
const idle = {timeout: 0, lastActive: Date.now(), renewed: 0, timer: null};

const IDLE_KEY = "gatewayd.console.idle";  // the gateway's console.idle_timeout, as its last renewal said

async function renewToken() {
  const answer = await api("POST", "/token/refresh");
  auth.token = answer.token;
  idle.timeout = answer.idle_timeout;
  idle.renewed = Date.now();
  localStorage.setItem(IDLE_KEY, String(answer.idle_timeout));
}

/** Seconds the kept token has left (from its ``exp``; the gateway verifies it, this only reads it). */
function tokenLeft() {
  try {
    const part = auth.token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
    const claims = JSON.parse(atob(part + "=".repeat((4 - part.length % 4) % 4)));
    return claims.exp - Date.now() / 1000;
  } catch {
    return Infinity;
  }
}

/** A token from a sign-in (long-lived) is exchanged for one that lasts the idle timeout; one already
 * exchanged is kept (a reload does not change it). */
async function shortToken() {
  const known = parseInt(localStorage.getItem(IDLE_KEY) || "0", 10);
  if (known && tokenLeft() <= known + 5) {
    idle.timeout = known;
    idle.renewed = Date.now() - (known * 1000 - tokenLeft() * 1000);
    return;
  }
  await renewToken();
}

function watchIdle() {
  clearInterval(idle.timer);
  idle.lastActive = Date.now();
  const every = () => Math.min(idle.timeout * 1000 / 3, 300000);
  idle.timer = setInterval(async () => {
    if (!state.me || !idle.timeout) return;
    const now = Date.now();
    if (now - idle.lastActive >= idle.timeout * 1000) {
      clearInterval(idle.timer);
      try { await api("POST", "/logout"); } catch { /* expired already */ }
      signOut(`Signed out after ${Math.round(idle.timeout / 60) || 1} minutes without activity.`);
      return;
    }
    if (idle.lastActive > idle.renewed && now - idle.renewed >= every()) {
      try { await renewToken(); } catch { /* a 401 signs out (whenSignedOut) */ }
    }
  }, 1000);
}

for (const kind of ["keydown", "pointerdown", "wheel", "scroll", "touchstart"]) {
  window.addEventListener(kind, () => { idle.lastActive = Date.now(); }, {passive: true, capture: true});
}

/** How many reviews wait for this person's decision (not their own requests), in the navigation. */
async function countPending(me) {
  try {
    const pending = await api("GET", "/reviews", {query: {status: "PENDING"}});
    const mine = pending.filter((r) => r.review_owner.id !== me.id || me.is_admin).length;
    const badge = document.getElementById("pending-count");
    if (badge) {
      badge.textContent = mine ? String(mine) : "";
      badge.hidden = !mine;
      badge.title = `${mine} review${mine === 1 ? "" : "s"} waiting for a decision`;
    }
  } catch { /* the count is a hint: the page works without it */ }
}

function renderNav() {
  const me = state.me;
  const nav = document.getElementById("nav");
  const who = document.getElementById("whoami");
  if (!me) {
    mount(nav);
    mount(who);
    return;
  }
  const {path} = current();
  const links = [["/sessions", "Sessions"], ["/reviews", "Reviews"], ["/connections", "Connections"],
    ["/runbooks", "Runbooks"], ["/guardrails", "Guard rails"]];
  if (me.is_admin || me.is_auditor) links.push(["/reports", "Reports"]);
  if (me.is_admin) links.push(["/audit", "Audit log"], ["/settings", "Settings"]);
  mount(nav, links.map(([href, label]) =>
    h("a", {href: `#${href}`, class: path.startsWith(href) ? "active" : ""}, label,
      href === "/reviews" ? h("span", {class: "badge count", id: "pending-count", hidden: true}) : null)));
  countPending(me);
  const roles = [me.is_admin && "admin", me.is_auditor && "auditor"].filter(Boolean);
  mount(who, h("span", {id: "me"}, me.email), roles.length ? h("span", {class: "badge"}, roles.join(", ")) : null,
    h("button", {type: "button", id: "sign-out", onclick: signOutHere}, "Sign out"));
}

function renderSignIn(message) {
  renderNav();
  // a self-service organization's own accounts sign in at /?org=<organization id> (e-mails are per organization)
  const org = new URLSearchParams(location.search).get("org") || "";
  const error = h("div", {class: "messages"}, message ? notice(message, "info") : null);
  const form = h("form", {id: "sign-in", class: "card narrow"},
    h("h1", {}, "Sign in"),
    org ? h("p", {class: "muted", id: "sign-in-org"}, `Organization ${org}`) : null,
    field("E-mail", h("input", {name: "email", type: "email", autocomplete: "username", required: true})),
    field("Password", h("input", {name: "password", type: "password", autocomplete: "current-password",
      required: true})),
    h("div", {class: "actions"}, h("button", {type: "submit", class: "primary"}, "Sign in")),
    h("hr"),
    h("button", {type: "button", id: "sso", onclick: singleSignOn}, "Sign in with single sign-on"),
    error);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const data = new FormData(form);
    try {
      const {token} = await api("POST", "/localauth/login",
        {body: {email: data.get("email"), password: data.get("password"), ...(org ? {org_id: org} : {})}});
      auth.token = token;
      await start();
    } catch (err) {
      mount(error, notice(err.status === 401 ? "Wrong e-mail or password." : err.message, "error"));
    }
  });
  async function singleSignOn() {
    try {
      const {login_url: url} = await api("GET", "/login", {query: {redirect: auth.startLogin()}});
      location.assign(url);
    } catch (err) {
      mount(error, notice(err.message, "error"));
    }
  }
  mount(main, form);
}

async function route() {
  if (!state.me) return;
  renderNav();
  const {path, params} = current();
  // each navigation renders into a part of the page of its own: a view still loading when the user
  // moves on renders into its detached part, never over the page that followed it
  const page = h("div", {class: "view"});
  mount(main, page);
  const ctx = {me: state.me, params, go, main: page};
  for (const [pattern, view] of ROUTES) {
    const match = path.match(pattern);
    if (match) {
      mount(page, h("p", {class: "muted"}, "Loading…"));
      try {
        await view(ctx, ...match.slice(1));
      } catch (err) {
        mount(page, h("h1", {}, "Error"), notice(err.message, "error"));
      }
      return;
    }
  }
  mount(page, h("h1", {}, "Not found"), notice(`No page at ${path}.`, "error"));
}

const IGNORED_LINK = "A sign-in link this page did not ask for was ignored: sign in here, if you meant to.";

async function start() {
  const link = auth.takeFromAddress();
  if (!auth.token) return renderSignIn(link === "ignored" ? IGNORED_LINK : undefined);
  try {
    await shortToken();  // a token that lasts console.idle_timeout, renewed while the page is used
    state.me = await api("GET", "/userinfo");
  } catch (err) {
    if (err.status !== 401) return mount(main, notice(err.message, "error"));
    return;  // whenSignedOut showed the sign-in form
  }
  // a link to one review (a Slack review request: /?review=ID) opens that review
  const review = new URLSearchParams(location.search).get("review");
  if (review) {
    const rest = new URLSearchParams(location.search);
    rest.delete("review");
    const left = rest.toString();
    history.replaceState(null, "", `${location.pathname}${left ? `?${left}` : ""}#/reviews?review=` +
      encodeURIComponent(review));
  }
  watchIdle();
  if (!location.hash) history.replaceState(null, "", "#/sessions");
  await route();
}

window.addEventListener("hashchange", route);
start();
