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
  const pages = Math.max(1, Math.ceil(result.pages.total / SIZE));
  mount(main, h("h1", {}, "Audit log"), form,
    h("table", {class: "grid", id: "audit"},
      h("thead", {}, h("tr", {}, ["When", "Actor", "Action", "Request", "Status", "Outcome", "Error"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, result.data.map((e) => h("tr", {class: e.outcome === "failure" ? "failed" : ""},
        h("td", {}, when(e.created_at)), h("td", {}, e.actor_email || e.actor_subject || "anonymous"),
        h("td", {}, e.action), h("td", {class: "mono"}, `${e.http_method} ${e.http_path}`),
        h("td", {}, String(e.http_status)), h("td", {}, e.outcome), h("td", {}, e.error_message || ""))))),
    h("div", {class: "pager"},
      h("button", {type: "button", disabled: page <= 1, onclick: () => go("/audit", {...filters, page: page - 1})},
        "← Newer"),
      h("span", {}, `page ${page} of ${pages} (${result.pages.total} entries)`),
      h("button", {type: "button", disabled: page >= pages, onclick: () => go("/audit", {...filters, page: page + 1})},
        "Older →")));
}
