// Runbooks: the ones you may run, each one's form (its parameters as the template declares them), the run, its
// review and its result. Everything goes through the API: POST /runbooks/exec runs it as POST /sessions would.
import {api} from "./api.js";
import {h, mount, notice, select, field} from "./dom.js";

const INPUT_TYPES = {number: "number", email: "email", url: "url", date: "date", time: "time", tel: "tel",
  password: "password", text: "text"};

export async function runbooksView({go, main}) {
  const listing = await api("GET", "/runbooks", {query: {list_connections: "true"}});
  const repositories = listing.repositories.map((repo) => h("section", {class: "card repository",
    dataset: {repository: repo.repository}},
  h("h2", {}, repo.repository),
  h("p", {class: "muted"}, `commit ${repo.commit.slice(0, 10)} · ${repo.commit_author} · ${repo.commit_message}`),
  repo.items.length ? h("table", {class: "grid runbooks"},
    h("thead", {}, h("tr", {}, ["Runbook", "Parameters", "Connections", ""].map((t) => h("th", {}, t)))),
    h("tbody", {}, repo.items.map((item) => h("tr", {dataset: {runbook: item.name}},
      h("td", {class: "mono"}, item.name),
      h("td", {}, Object.keys(item.metadata).join(", ") || "none"),
      h("td", {}, (item.connections || []).join(", ")),
      h("td", {}, item.error ? h("span", {class: "badge rejected", title: item.error}, "cannot run") :
        h("button", {type: "button", class: "primary open-runbook",
          onclick: () => go("/runbooks/run", {repository: repo.repository, name: item.name})}, "Open")))))) :
    h("p", {class: "muted"}, "No runbook you may run here.")));
  mount(main, h("h1", {}, "Runbooks"),
    listing.errors.length ? listing.errors.map((e) => notice(e, "error")) : null,
    h("div", {class: "controls"}, h("button", {type: "button", id: "refresh-runbooks", onclick: async () => {
      await api("GET", "/runbooks", {query: {refresh: "true"}});
      go("/runbooks", {fetched: Date.now()});
    }}, "Fetch the repositories now")),
    repositories.length ? repositories : h("p", {class: "muted"}, "No runbook repository."));
}

/** The form field of one parameter, as its declaration says (type, options, default, required, placeholder). */
function input(name, spec) {
  const common = {name, required: Boolean(spec.required), placeholder: spec.placeholder || null,
    dataset: {parameter: name}};
  if (spec.type === "select") {
    return select(name, [...(spec.required ? [] : [["", "—"]]), ...(spec.options || []).map((o) => [o, o])],
      spec.default || "", common);
  }
  if (spec.type === "textarea") return h("textarea", {...common, rows: 4}, spec.default || "");
  return h("input", {...common, type: INPUT_TYPES[spec.type] || "text", value: spec.default || "",
    step: spec.type === "number" ? "any" : null, autocomplete: spec.type === "password" ? "off" : null});
}

function resultCard(result) {
  return h("div", {class: "card result", id: "runbook-result"},
    h("p", {}, "Exit code ", h("strong", {id: "exit-code"}, String(result.exit_code)), " · ",
      h("a", {href: `#/sessions/${encodeURIComponent(result.session_id)}`, id: "result-session"}, "the session")),
    h("pre", {class: "code", id: "runbook-output"}, result.output || "(no output)"));
}

export async function runbookRunView({params, main}) {
  const repository = params.get("repository");
  const name = params.get("name");
  const listing = await api("GET", "/runbooks", {query: {list_connections: "true"}});
  const repo = listing.repositories.find((r) => r.repository === repository);
  const item = repo && repo.items.find((i) => i.name === name);
  if (!item) {
    mount(main, h("h1", {}, "Runbook"), notice(`No runbook ${name} you may run in ${repository}.`, "error"));
    return;
  }
  const fields = Object.entries(item.metadata).sort(([, a], [, b]) =>
    (a.order ?? Number.MAX_SAFE_INTEGER) - (b.order ?? Number.MAX_SAFE_INTEGER));
  const outcome = h("div", {class: "messages", id: "runbook-outcome"});
  const connection = select("connection", (item.connections || []).map((c) => [c, c]),
    (item.connections || [])[0] || "", {id: "runbook-connection", required: true});
  const form = h("form", {class: "card", id: "runbook-form"},
    field("Connection", connection),
    fields.map(([key, spec]) => field(`${key}${spec.required ? " *" : ""}${spec.description ?
      ` — ${spec.description}` : ""}`, input(key, spec))),
    h("div", {class: "actions"}, h("button", {type: "submit", class: "primary", id: "run-runbook"}, "Run")),
    outcome);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const data = new FormData(form);
    const parameters = {};
    for (const [key] of fields) if (data.get(key) !== "") parameters[key] = String(data.get(key));
    mount(outcome, h("p", {class: "muted"}, "Running…"));
    try {
      const result = await api("POST", "/runbooks/exec", {body: {connection_name: data.get("connection"),
        repository, file_name: name, ref_hash: repo.commit, parameters}});
      showOutcome(outcome, result);
    } catch (err) {
      mount(outcome, notice(err.message, "error"));
    }
  });
  mount(main, h("h1", {}, name),
    h("p", {class: "muted"}, `${repository} · commit ${repo.commit.slice(0, 10)}`),
    item.connections && item.connections.length ? form : notice("No connection may run this runbook for you.",
      "error"));
}

/** What a run answered: its result, or its review (and, once approved, running it). */
function showOutcome(outcome, result) {
  if (!result.has_review || result.output_status) {
    if (result.output_status === "running") {
      mount(outcome, notice("Still running: its session shows the output as it comes.", "info"),
        h("a", {href: `#/sessions/${encodeURIComponent(result.session_id)}`}, "the session"));
      return;
    }
    mount(outcome, resultCard(result));
    return;
  }
  const state = h("span", {class: "badge", id: "review-state"}, result.review ? result.review.status : "PENDING");
  const messages = h("div", {class: "messages"});
  async function runApproved() {
    try {
      const review = await api("GET", `/reviews/${encodeURIComponent(result.review_id)}`);
      state.textContent = review.status;
      if (review.status !== "APPROVED") {
        mount(messages, notice(`The review is ${review.status.toLowerCase()}: it runs once approved.`, "info"));
        return;
      }
      const ran = await api("POST", `/sessions/${encodeURIComponent(result.session_id)}/exec`);
      mount(outcome, resultCard(ran));
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  }
  mount(outcome, h("div", {class: "card", id: "runbook-review"},
    h("p", {}, "This connection asks for a review first. Review ", state, " · ",
      h("a", {href: `#/reviews?review=${encodeURIComponent(result.review_id)}`, id: "review-link"}, "see it")),
    h("div", {class: "actions"}, h("button", {type: "button", class: "primary", id: "run-approved",
      onclick: runApproved}, "Run it (once approved)")),
    messages));
}
