// Connections: get access (a credential and the command to paste), waiting for a jit review when one is needed.
import {api} from "./api.js";
import {h, mount, when, notice, select} from "./dom.js";

const DURATIONS = [["900", "15 min"], ["1800", "30 min"], ["3600", "1 h"], ["14400", "4 h"]];

export async function connectionsView({me, main}) {
  const [connections, reviews] = await Promise.all([api("GET", "/connections"), api("GET", "/reviews",
    {query: {type: "jit"}})]);
  // my newest jit request per connection that may still give access: shown again after a reload
  const asked = new Map();
  for (const r of reviews) {
    if (r.review_owner.id === me.id && ["PENDING", "APPROVED"].includes(r.status) &&
        !asked.has(r.review_connection.name)) asked.set(r.review_connection.name, r);
  }
  mount(main, h("h1", {}, "Connections"),
    h("div", {class: "scroll"}, h("table", {class: "grid", id: "connections"},
      h("thead", {}, h("tr", {}, ["Name", "Protocol", "Reviewed by", "Access"].map((t) => h("th", {}, t)))),
      h("tbody", {}, connections.map((conn) => row(conn, asked.get(conn.name)))))));
}

/** Who reviews access to a connection (its access request rules or its settings), as the API says. */
export function reviewedBy(conn) {
  const policy = conn.review_policy;
  if (!policy) return (conn.reviewers || []).length ? `by ${conn.reviewers.join(", ")}` : "none";
  const parts = [];
  if (policy.jit) parts.push(`access: ${policy.jit.reviewers.join(", ")}`);
  if (policy.exec) parts.push(`scripts: ${policy.exec.reviewers.join(", ")}`);
  return parts.length ? parts.join(" · ") : "none";
}

function row(conn, request) {
  const out = h("div", {class: "access"});
  const length = select("duration", DURATIONS, "1800");
  const reason = h("input", {name: "reason", class: "reason", placeholder: "why (for the reviewers)",
    hidden: !conn.review_policy || !conn.review_policy.jit});
  const button = h("button", {type: "button", class: "primary get-access", onclick: getAccess}, "Get access");
  async function getAccess() {
    button.disabled = true;
    try {
      const body = {access_duration_seconds: parseInt(length.value, 10)};
      if (reason.value.trim()) body.reason = reason.value.trim();
      const {status, body: got} = await api("POST", `/connections/${encodeURIComponent(conn.name)}/credentials`,
        {body, as: "full"});
      const answer = got;
      if (status === 202) pending(answer);
      else show(answer);
    } catch (err) {
      mount(out, notice(err.message, "error"));
    } finally {
      button.disabled = false;
    }
  }
  function pending(body) {
    const check = h("button", {type: "button", class: "check-access", onclick: async () => {
      try {
        const {status, body: got} = await api("POST",
          `/connections/${encodeURIComponent(conn.name)}/credentials/${encodeURIComponent(body.session_id)}`,
          {body: {}, as: "full"});
        if (status === 202) mount(waiting, notice(`Still waiting for review ${body.review_id.slice(0, 8)}.`, "info"));
        else show(got);
      } catch (err) {
        mount(waiting, notice(err.message, "error"));
      }
    }}, "Check again");
    const waiting = h("div");
    const approved = body.review && body.review.status === "APPROVED";
    const groups = ((body.review && body.review.review_groups_data) || []).map((g) => g.group);
    mount(out, notice(approved ? `Your access request ${body.review_id.slice(0, 8)} is approved: get its credential.` :
      `Access needs a review: request ${body.review_id.slice(0, 8)} is pending (reviewers: ` +
      `${groups.join(", ") || "their groups"}).`, "info"), check, waiting);
  }
  function show(cred) {
    const c = cred.connection_credentials || {};
    const command = c.connection_string ? `psql "${c.connection_string}"` : c.command || c.url || "";
    const copy = h("button", {type: "button", class: "copy", onclick: async () => {
      try {
        await navigator.clipboard.writeText(command);
        copy.textContent = "Copied";
      } catch {
        text.focus();
        text.select();
        copy.textContent = "Press Ctrl+C";
      }
    }}, "Copy");
    const text = h("input", {class: "command mono", readonly: true, value: command, size: 60});
    const extra = [["Host", c.hostname], ["Port", c.port], ["User", c.username], ["Header", c.header]]
      .filter(([, v]) => v);
    mount(out, h("div", {class: "credential"}, h("div", {class: "controls"}, text, copy),
      h("p", {class: "muted"}, extra.map(([k, v]) => `${k}: ${v}`).join(" · "),
        cred.expire_at ? ` · valid until ${when(cred.expire_at)}` : "")));
  }
  if (request) pending({session_id: request.session_id, review_id: request.id, review: request});
  return h("tr", {dataset: {connection: conn.name}},
    h("td", {}, conn.name),
    h("td", {}, `${conn.subtype || conn.type}`),
    h("td", {class: "review-by"}, reviewedBy(conn)),
    h("td", {}, h("div", {class: "controls"}, length, reason, button), out));
}
