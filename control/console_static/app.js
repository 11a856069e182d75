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
    h("a", {href: `#${href}`, class: path.startsWith(href) ? "active" : ""}, label)));
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
  if (!location.hash) history.replaceState(null, "", "#/sessions");
  await route();
}

window.addEventListener("hashchange", route);
start();
