// The review queue: what was asked (the script, or access for a while), approve / reject / revoke.
import {api} from "./api.js";
import {h, mount, when, notice, select, field} from "./dom.js";

const STATUSES = [["PENDING", "pending"], ["", "all"], ["APPROVED", "approved"], ["REJECTED", "rejected"],
  ["REVOKED", "revoked"], ["EXECUTED", "executed"]];

function duration(ns) {
  const minutes = Math.round(ns / 6e10);
  return minutes >= 60 ? `${(minutes / 60).toFixed(minutes % 60 ? 1 : 0)} h` : `${minutes} min`;
}

export async function reviewsView({me, params, go, main}) {
  if (params.get("review")) {  // one review, as a link names it (a Slack review request)
    const one = await api("GET", `/reviews/${encodeURIComponent(params.get("review"))}`);
    mount(main, h("h1", {}, "Review"), h("div", {id: "reviews"}, reviewCard(one, me)),
      h("p", {}, h("a", {href: "#/reviews"}, "Every review")));
    return;
  }
  const chosen = params.has("status") ? params.get("status") : "PENDING";
  const status = chosen === "all" ? "" : chosen;  // "all" in the address: no filter for the API
  const reviews = await api("GET", "/reviews", {query: {status}});
  const filter = select("status", STATUSES, status, {id: "review-status",
    onchange: (e) => go("/reviews", {status: e.target.value || "all"})});
  mount(main, h("h1", {}, "Reviews"), h("div", {class: "controls"}, field("Status", filter)),
    reviews.length ? h("div", {id: "reviews"}, reviews.map((r) => reviewCard(r, me))) :
      h("p", {class: "muted", id: "no-reviews"}, "Nothing here."));
}

function reviewCard(review, me) {
  const messages = h("div", {class: "messages"});
  const asked = h("div", {class: "asked"});
  const statusBadge = h("span", {class: `badge ${review.status.toLowerCase()}`}, review.status);
  if (review.type === "jit") {
    mount(asked, `Access to ${review.review_connection.name} for ${duration(review.access_duration)}`);
  } else {
    mount(asked, h("pre", {class: "code script"}, review.input || "(empty script)"));
  }
  const from = h("input", {type: "time", name: "start_time"});
  const to = h("input", {type: "time", name: "end_time"});
  async function decide(decision) {
    const body = {status: decision};
    if (decision === "APPROVED" && (from.value || to.value)) {
      body.time_window = {type: "time_range", configuration: {start_time: from.value, end_time: to.value}};
    }
    try {
      const updated = await api("PUT", `/reviews/${encodeURIComponent(review.id)}`, {body});
      statusBadge.textContent = updated.status;
      statusBadge.className = `badge ${updated.status.toLowerCase()}`;
      mount(messages, notice(`Review ${updated.status.toLowerCase()}.`, "ok"));
      mount(buttons, updated.status === "APPROVED" && review.type === "jit" ? revoke() : null);
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  }
  const revoke = () => h("button", {type: "button", class: "danger revoke", onclick: () => decide("REVOKED")}, "Revoke");
  const buttons = h("div", {class: "actions"});
  const mine = review.review_owner.id === me.id;
  if (review.status === "PENDING" && mine && !me.is_admin) {  // the API refuses to let you approve your own
    mount(buttons, h("span", {class: "muted"}, "Waiting for its reviewers."));
  } else if (review.status === "PENDING") {
    mount(buttons,
      review.type !== "jit" ? h("span", {class: "window"}, "Time window (UTC, optional) ", from, " – ", to) : null,
      h("button", {type: "button", class: "primary approve", onclick: () => decide("APPROVED")}, "Approve"),
      h("button", {type: "button", class: "reject", onclick: () => decide("REJECTED")}, "Reject"));
  } else if (review.status === "APPROVED" && review.type === "jit") {  // the API revokes jit access only
    mount(buttons, revoke());
  }
  const groups = review.review_groups_data.map((g) =>
    `${g.group}: ${g.status || "waiting"}${g.reviewed_by ? ` (${g.reviewed_by.email})` : ""}`).join(" · ");
  const owner = review.review_owner;
  return h("article", {class: "card review", dataset: {review: review.id}},
    h("header", {},
      h("strong", {}, review.type === "jit" ? "Access request" : "Script"), " on ",
      h("strong", {class: "connection"}, review.review_connection.name), " by ",
      h("span", {class: "requester"}, owner.name ? `${owner.name} <${owner.email}>` : owner.email),
      mine ? " (you)" : "", " ", statusBadge, " ", h("span", {class: "muted mono"}, review.id.slice(0, 8))),
    h("p", {class: "reason"}, h("span", {class: "muted"}, "Why: "), review.reason || "(no reason given)"),
    h("p", {class: "muted"}, `asked ${when(review.created_at)} · ${groups}`,
      review.time_window ? ` · window ${review.time_window.configuration.start_time}–` +
        `${review.time_window.configuration.end_time} UTC` : ""),
    asked, buttons, messages);
}
