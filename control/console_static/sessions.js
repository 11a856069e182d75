// The sessions list: find sessions by user, connection, protocol, status, text typed in them and time (to the
// minute), paged; the API does the finding.
import {api, protocols} from "./api.js";
import {h, mount, when, select, field} from "./dom.js";

const PAGE = 20;
const STATUSES = [["", "any status"], ["open", "live"], ["done", "done"], ["ready", "issued, not used"]];
const REVIEW = [["", "any review"], ["PENDING", "pending"], ["APPROVED", "approved"], ["REJECTED", "rejected"],
  ["REVOKED", "revoked"], ["EXECUTED", "executed"]];
const FILTERS = ["user", "connection", "protocol", "status", "search", "review.status", "start_date", "end_date"];

/** A session's status as people read it: live (open), done, or a credential issued and not used yet. */
export function statusBadge(session) {
  if (session.status === "ready") {
    const issued = session.verb === "connect";
    return h("span", {class: "badge issued", title: issued ? "a credential was issued and not used yet" :
      "waiting to run"}, issued ? "issued" : "waiting");
  }
  const live = session.status === "open";
  return h("span", {class: `badge ${live ? "live" : ""}`, title: live ? "live session" : ""},
    live ? "● live" : session.status);
}

/** A datetime-local value (UTC, to the minute) as the API's RFC 3339; ``end``: the whole minute. */
function toApi(value, end) {
  return value ? `${value}:${end ? "59.999999" : "00"}Z` : "";
}

/** An RFC 3339 time as a datetime-local value (to the minute). */
function fromApi(value) {
  return value ? value.slice(0, 16) : "";
}

export async function sessionsView({params, go, main}) {
  const offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
  const query = {limit: PAGE, offset};
  for (const name of FILTERS) query[name] = params.get(name) || "";
  const [page, known] = await Promise.all([api("GET", "/sessions", {query}), protocols()]);
  const choices = [["", "any protocol"], ...[...known.values()].map((p) => [p.subtype, p.title])];

  const form = h("form", {class: "filters", id: "session-filters"},
    field("User", h("input", {name: "user", value: query.user, placeholder: "part of an e-mail or name"})),
    field("Connection", h("input", {name: "connection", value: query.connection})),
    field("Protocol", select("protocol", choices, query.protocol)),
    field("Status", select("status", STATUSES, query.status)),
    field("Typed in it", h("input", {name: "search", type: "search", value: query.search, minlength: 3,
      placeholder: "a statement, a command, a URL"})),
    field("Review", select("review.status", REVIEW, query["review.status"])),
    field("From (UTC)", h("input", {name: "start_date", type: "datetime-local", value: fromApi(query.start_date)})),
    field("To (UTC)", h("input", {name: "end_date", type: "datetime-local", value: fromApi(query.end_date)})),
    h("div", {class: "actions"}, h("button", {type: "submit", class: "primary"}, "Find"),
      h("button", {type: "button", onclick: () => go("/sessions")}, "Clear")));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = Object.fromEntries(new FormData(form));
    chosen.start_date = toApi(chosen.start_date, false);
    chosen.end_date = toApi(chosen.end_date, true);
    go("/sessions", chosen);
  });

  const filters = Object.fromEntries(FILTERS.map((name) => [name, query[name]]));
  const first = page.total ? offset + 1 : 0;
  const last = offset + page.data.length;
  const rows = page.data.map((s) => h("tr", {dataset: {session: s.id}},
    h("td", {}, h("a", {href: `#/sessions/${encodeURIComponent(s.id)}`}, when(s.start_date))),
    h("td", {}, s.user),
    h("td", {}, s.connection),
    h("td", {}, s.connection_subtype || s.type),
    h("td", {}, s.verb),
    h("td", {}, statusBadge(s)),
    h("td", {}, s.review ? s.review.status : "")));
  mount(main,
    h("h1", {}, "Sessions"),
    form,
    h("div", {class: "scroll"}, h("table", {class: "grid", id: "sessions"},
      h("thead", {}, h("tr", {}, ["Started", "User", "Connection", "Protocol", "Verb", "Status", "Review"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", {colspan: 7, class: "muted"}, "No sessions."))))),
    h("div", {class: "pager"},
      h("button", {type: "button", id: "prev-page", disabled: offset === 0,
        onclick: () => go("/sessions", {...filters, offset: Math.max(0, offset - PAGE)})}, "← Newer"),
      h("span", {id: "page-info"}, `${first}–${last} of ${page.total}${page.total_exact === false ? "+" : ""}`),
      h("button", {type: "button", id: "next-page", disabled: !page.has_next_page,
        onclick: () => go("/sessions", {...filters, offset: offset + PAGE})}, "Older →")));
}
