// The organization's settings (admins): its features, its API key (shown once), its webhooks and their log.
import {api} from "./api.js";
import {h, mount, notice, when, field} from "./dom.js";

function section(title, ...children) {
  return h("section", {class: "card settings"}, h("h2", {}, title), ...children);
}

async function featuresSection(refresh) {
  const features = await api("GET", "/orgs/features");
  const messages = h("div", {class: "messages"});
  return section("Features", h("table", {class: "grid", id: "features"}, h("tbody", {}, features.map((f) =>
    h("tr", {dataset: {feature: f.name}},
      h("td", {}, h("strong", {}, f.name), h("div", {class: "muted"}, f.description)),
      h("td", {}, h("span", {class: `badge ${f.status === "enabled" ? "approved" : "rejected"}`}, f.status)),
      h("td", {}, h("button", {type: "button", class: "toggle-feature", onclick: async () => {
        try {
          await api("PUT", "/orgs/features", {body: {name: f.name,
            status: f.status === "enabled" ? "disabled" : "enabled"}});
          refresh();
        } catch (err) {
          mount(messages, notice(err.message, "error"));
        }
      }}, f.status === "enabled" ? "Switch off" : "Switch on")))))), messages);
}

async function keySection(refresh) {
  const messages = h("div", {class: "messages"});
  let key = null;
  try {
    key = await api("GET", "/orgs/keys");
  } catch (err) {
    if (err.status !== 404) throw err;
  }
  const make = async () => {
    try {
      const made = await api("POST", "/orgs/keys");
      mount(messages, notice("Copy the key now: it is not shown again.", "info"),
        h("pre", {class: "code", id: "new-org-key"}, made.key));
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  };
  const revoke = async () => {
    try {
      await api("DELETE", "/orgs/keys");
      refresh();
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  };
  return section("API key",
    h("p", {class: "muted"}, "Scripts send it as the Api-Key header; it acts as the organization's service account."),
    key ? h("p", {id: "org-key"}, h("span", {class: "mono"}, `${key.key_prefix}…`), ` made ${when(key.created_at)}`,
      ` by ${key.created_by}`, key.last_used_at ? `, last used ${when(key.last_used_at)}` : ", never used") :
      h("p", {class: "muted", id: "org-key"}, "No key."),
    h("div", {class: "actions"}, key ?
      h("button", {type: "button", class: "danger", id: "revoke-org-key", onclick: revoke}, "Revoke") :
      h("button", {type: "button", class: "primary", id: "make-org-key", onclick: make}, "Make a key")),
    messages);
}

async function webhooksSection(refresh) {
  const [plugins, endpoints, types, log] = await Promise.all([api("GET", "/plugins"),
    api("GET", "/webhooks/endpoints"), api("GET", "/webhooks/eventtypes"),
    api("GET", "/webhooks/messages", {query: {limit: 20}})]);
  const on = plugins.some((p) => p.name === "webhooks");
  const messages = h("div", {class: "messages"});
  const act = (work) => async () => {
    try {
      await work();
      refresh();
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  };
  const form = h("form", {class: "filters", id: "add-endpoint"},
    field("URL (https)", h("input", {name: "url", type: "url", required: true, size: 40})),
    h("fieldset", {class: "event-types"}, h("legend", {}, "Events (none: all)"),
      types.filter((t) => t.name !== "ping").map((t) => h("label", {title: t.description},
        h("input", {type: "checkbox", name: "event_types", value: t.name}), ` ${t.name} `))),
    h("button", {type: "submit", class: "primary"}, "Add"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const data = new FormData(form);
    try {
      const made = await api("POST", "/webhooks/endpoints", {body: {url: data.get("url"),
        event_types: data.getAll("event_types")}});
      mount(messages, notice("The endpoint's signing secret, shown this once:", "info"),
        h("pre", {class: "code", id: "endpoint-secret"}, made.secret));
      form.reset();
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  });
  return section("Webhooks",
    h("p", {}, "Plugin ", h("span", {class: `badge ${on ? "approved" : "rejected"}`, id: "webhooks-plugin"},
      on ? "on" : "off"), " ",
    h("button", {type: "button", id: "toggle-webhooks", onclick: act(() => on ?
      api("DELETE", "/plugins/webhooks") : api("POST", "/plugins", {body: {name: "webhooks"}}))},
    on ? "Turn off" : "Turn on"),
    " ", h("button", {type: "button", id: "send-ping", disabled: !on || !endpoints.length,
      onclick: act(() => api("POST", "/webhooks/messages", {body: {}}))}, "Send a test event")),
    h("table", {class: "grid", id: "endpoints"},
      h("thead", {}, h("tr", {}, ["URL", "Events", ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, endpoints.length ? endpoints.map((e) => h("tr", {dataset: {endpoint: e.id}},
        h("td", {class: "mono"}, e.url), h("td", {}, e.event_types.join(", ") || "all"),
        h("td", {}, h("button", {type: "button", class: "danger delete-endpoint",
          onclick: act(() => api("DELETE", `/webhooks/endpoints/${encodeURIComponent(e.id)}`))}, "Remove")))) :
        h("tr", {}, h("td", {colspan: 3, class: "muted"}, "No endpoint.")))),
    form, messages,
    h("h3", {}, "Deliveries"),
    h("table", {class: "grid", id: "deliveries"},
      h("thead", {}, h("tr", {}, ["When", "Event", "To", "Status", "Attempts", "Last answer"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, log.data.length ? log.data.map((d) => h("tr", {dataset: {delivery: d.id}},
        h("td", {}, when(d.created_at)), h("td", {}, d.event_type), h("td", {}, d.channel),
        h("td", {}, h("span", {class: `badge ${d.status === "delivered" ? "approved" : d.status === "failed" ?
          "rejected" : ""}`}, d.status)),
        h("td", {class: "number"}, String(d.attempts)), h("td", {}, d.last_error || (d.last_status ?? "")))) :
        h("tr", {}, h("td", {colspan: 6, class: "muted"}, "Nothing sent yet.")))));
}

export async function settingsView({go, main}) {
  const refresh = () => go("/settings", {at: Date.now()});
  mount(main, h("h1", {}, "Settings"), await featuresSection(refresh), await keySection(refresh),
    await webhooksSection(refresh));
}
