// Session reports (admins and auditors): finished sessions by connection, user, protocol or day, over days.
import {api} from "./api.js";
import {h, mount, select, field} from "./dom.js";

const GROUPS = [["connection", "connection"], ["user", "user"], ["protocol", "protocol"], ["day", "day"]];

function seconds(total) {
  if (total < 120) return `${total} s`;
  if (total < 7200) return `${Math.round(total / 60)} min`;
  return `${(total / 3600).toFixed(1)} h`;
}

export async function reportsView({params, go, main}) {
  const query = {group_by: params.get("group_by") || "connection", start_date: params.get("start_date") || "",
    end_date: params.get("end_date") || ""};
  const report = await api("GET", "/reports/sessions", {query});
  const form = h("form", {class: "filters", id: "report-filters"},
    field("Group by", select("group_by", GROUPS, report.group_by)),
    field("From", h("input", {name: "start_date", type: "date", value: report.start_date})),
    field("To", h("input", {name: "end_date", type: "date", value: report.end_date})),
    h("button", {type: "submit", class: "primary"}, "Show"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    go("/reports", Object.fromEntries(new FormData(form)));
  });
  const columns = ["sessions", "duration_seconds", "bytes", "blocks", "masked"];
  const cells = (row) => [row.sessions, seconds(row.duration_seconds), row.bytes, row.blocks, row.masked]
    .map((value) => h("td", {class: "number"}, String(value)));
  mount(main, h("h1", {}, "Reports"), form,
    h("table", {class: "grid", id: "report"},
      h("thead", {}, h("tr", {}, [report.group_by, "Sessions", "Time", "Bytes", "Guard-rail blocks",
        "Masked values"].map((t) => h("th", {}, t)))),
      h("tbody", {}, report.items.length ? report.items.map((row) =>
        h("tr", {dataset: {resource: row.resource}}, h("td", {}, row.resource), cells(row))) :
        h("tr", {}, h("td", {colspan: columns.length + 1, class: "muted"}, "No finished session in these days."))),
      h("tfoot", {}, h("tr", {}, h("th", {}, "Total"), cells(report.totals)))));
}
