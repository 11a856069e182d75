// The security audit log (admins; the API refuses anyone else), with its filters and pages.
import {api} from "./api.js";
import {h, mount, when, select, field} from "./dom.js";

const FILTERS = ["actor", "resource_type", "action", "outcome", "created_after", "created_before"];
const SIZE = 50;

export async function auditView({params, go, main}) {
  const page = Math.max(1, parseInt(params.get("page") || "1", 10) || 1);
  const query = {page, page_size: SIZE};
  for (const name of FILTERS) query[name] = params.get(name) || "";
  const result = await api("GET", "/audit/logs", {query});
  const form = h("form", {class: "filters", id: "audit-filters"},
    field("Actor", h("input", {name: "actor", value: query.actor, placeholder: "e-mail or subject"})),
    field("Resource", h("input", {name: "resource_type", value: query.resource_type})),
    field("Action", h("input", {name: "action", value: query.action})),
    field("Outcome", select("outcome", [["", "any"], ["success", "success"], ["failure", "failure"]], query.outcome)),
    field("After", h("input", {name: "created_after", type: "date", value: query.created_after})),
    field("Before", h("input", {name: "created_before", type: "date", value: query.created_before})),
    h("button", {type: "submit", class: "primary"}, "Filter"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    go("/audit", Object.fromEntries(new FormData(form)));
  });
  const filters = Object.fromEntries(FILTERS.map((name) => [name, query[name]]));
  // past the store's count cap the total is a lower bound ("10000+"): the pages then go on while entries follow
  const more = result.pages.total_exact === false ? "+" : "";
  const pages = Math.max(1, Math.ceil(result.pages.total / SIZE));
  mount(main, h("h1", {}, "Audit log"), form,
    h("div", {class: "scroll"}, h("table", {class: "grid", id: "audit"},
      h("thead", {}, h("tr", {}, ["When", "Actor", "Action", "What", "Status", "Outcome", "Error"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, result.data.map((e) => h("tr", {class: e.outcome === "failure" ? "failed" : ""},
        h("td", {}, when(e.created_at)), h("td", {}, e.actor_email || e.actor_subject || "anonymous"),
        h("td", {}, e.action), h("td", {class: "mono what"}, what(e)),
        h("td", {}, e.http_status ? String(e.http_status) : "—"), h("td", {}, e.outcome),
        h("td", {}, e.error_message || "")))))),
    h("div", {class: "pager"},
      h("button", {type: "button", disabled: page <= 1, onclick: () => go("/audit", {...filters, page: page - 1})},
        "← Newer"),
      h("span", {id: "audit-page-info"}, `page ${page} of ${pages}${more} (${result.pages.total}${more} entries)`),
      h("button", {type: "button", id: "audit-next-page", disabled: !result.pages.has_next_page,
        onclick: () => go("/audit", {...filters, page: page + 1})},
        "Older →")));
}

/** What an entry is about: the API call, or for what happened in a session (a guard-rail block, a login through
 * a proxy) the connection, the input refused and a link to the session. */
function what(entry) {
  const payload = entry.request_payload_redacted && typeof entry.request_payload_redacted === "object"
    ? entry.request_payload_redacted : {};
  const parts = [];
  if (entry.http_method) parts.push(`${entry.http_method} ${entry.http_path}`);
  if (payload.connection && !entry.http_method) parts.push(`on ${payload.connection}`);
  if (payload.input) parts.push(h("span", {class: "input"}, ` ${payload.input}`));
  if (payload.session_id) {
    parts.push(" ", h("a", {href: `#/sessions/${encodeURIComponent(payload.session_id)}`, class: "session-link"},
      `session ${String(payload.session_id).slice(0, 8)}`));
  }
  return parts.length ? parts : "—";
}
