// The sessions list: the API's filters (user, connection, type, review status, dates) and paging.
import {api} from "./api.js";
import {h, mount, when, select, field} from "./dom.js";

const PAGE = 20;
const TYPES = [["", "any type"], ["database", "database"], ["custom", "custom (ssh, rdp)"],
  ["application", "application"], ["httpproxy", "http proxy"]];
const REVIEW = [["", "any review"], ["PENDING", "pending"], ["APPROVED", "approved"], ["REJECTED", "rejected"],
  ["REVOKED", "revoked"], ["EXECUTED", "executed"]];
const FILTERS = ["user", "connection", "type", "review.status", "start_date", "end_date"];

export function statusBadge(session) {
  const live = session.status !== "done";
  return h("span", {class: `badge ${live ? "live" : ""}`, title: live ? "live session" : ""},
    live ? `● ${session.status}` : session.status);
}

export async function sessionsView({params, go, main}) {
  const offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
  const query = {limit: PAGE, offset};
  for (const name of FILTERS) query[name] = params.get(name) || "";
  const page = await api("GET", "/sessions", {query});

  const form = h("form", {class: "filters", id: "session-filters"},
    field("User (subject)", h("input", {name: "user", value: query.user})),
    field("Connection", h("input", {name: "connection", value: query.connection})),
    field("Type", select("type", TYPES, query.type)),
    field("Review", select("review.status", REVIEW, query["review.status"])),
    field("From", h("input", {name: "start_date", type: "date", value: query.start_date})),
    field("To", h("input", {name: "end_date", type: "date", value: query.end_date})),
    h("button", {type: "submit", class: "primary"}, "Filter"),
    h("button", {type: "button", onclick: () => go("/sessions")}, "Clear"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    go("/sessions", Object.fromEntries(new FormData(form)));
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
    h("table", {class: "grid", id: "sessions"},
      h("thead", {}, h("tr", {}, ["Started", "User", "Connection", "Protocol", "Verb", "Status", "Review"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", {colspan: 7, class: "muted"}, "No sessions.")))),
    h("div", {class: "pager"},
      h("button", {type: "button", id: "prev-page", disabled: offset === 0,
        onclick: () => go("/sessions", {...filters, offset: Math.max(0, offset - PAGE)})}, "← Newer"),
      h("span", {id: "page-info"}, `${first}–${last} of ${page.total}`),
      h("button", {type: "button", id: "next-page", disabled: !page.has_next_page,
        onclick: () => go("/sessions", {...filters, offset: offset + PAGE})}, "Older →")));
}
