// Guard rails: the list, and a form to create or edit one, its regular expressions checked as you type.
import {api} from "./api.js";
import {h, mount, notice, select, field} from "./dom.js";

const KINDS = [["deny_words_list", "deny words"], ["pattern_match", "pattern (regex)"]];

export async function guardrailsView({me, main}) {
  const [rails, connections] = await Promise.all([api("GET", "/guardrails"), api("GET", "/connections")]);
  const names = new Map(connections.map((c) => [c.id, c.name]));
  const count = (side) => (side && side.rules ? side.rules.length : 0);
  mount(main, h("h1", {}, "Guard rails"),
    me.is_admin ? h("p", {}, h("a", {href: "#/guardrails/new", class: "button primary", id: "new-guardrail"},
      "New guard rail")) : null,
    h("table", {class: "grid", id: "guardrails"},
      h("thead", {}, h("tr", {}, ["Name", "Description", "Connections", "Input rules", "Output rules"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, rails.length ? rails.map((r) => h("tr", {dataset: {guardrail: r.name}},
        h("td", {}, me.is_admin ? h("a", {href: `#/guardrails/${encodeURIComponent(r.id)}`}, r.name) : r.name),
        h("td", {}, r.description),
        h("td", {}, r.connection_ids.map((id) => names.get(id) || id).join(", ")),
        h("td", {}, String(count(r.input))), h("td", {}, String(count(r.output))))) :
        h("tr", {}, h("td", {colspan: 5, class: "muted"}, "No guard rails.")))));
}

/** Why ``pattern`` would be refused, or "" (a first check here; the API has the last word on save). */
export function patternProblem(pattern) {
  if (!pattern) return "a pattern is required";
  const unsupported = [[/\(\?<?[=!]/, "look-around assertions (?= (?! (?<= (?<! are not supported by RE2"],
    [/\\[1-9]/, "back-references (\\1 …) are not supported by RE2"], [/\\k</, "named back-references are not supported by RE2"]];
  for (const [test, message] of unsupported) if (test.test(pattern)) return message;
  try {
    new RegExp(pattern.replace(/\(\?P</g, "(?<"));
  } catch (err) {
    return err.message.replace(/^Invalid regular expression: /, "");
  }
  return "";
}

function ruleRow(rule, onRemove) {
  const kind = select("type", KINDS, rule.type || "deny_words_list", {class: "rule-type"});
  const value = h("input", {class: "rule-value", size: 40,
    value: rule.type === "pattern_match" ? rule.pattern_regex || "" : (rule.words || []).join(", ")});
  const message = h("input", {class: "rule-message", placeholder: "message (optional)", value: rule.message || ""});
  const check = h("span", {class: "rule-check", role: "status"});
  function validate() {
    if (kind.value !== "pattern_match") {
      value.placeholder = "words, comma separated";
      check.textContent = "";
      check.className = "rule-check";
      value.setCustomValidity("");
      return;
    }
    value.placeholder = "regular expression (RE2 syntax)";
    const problem = patternProblem(value.value);
    check.textContent = problem ? `✗ ${problem}` : "✓ valid syntax";
    check.className = `rule-check ${problem ? "bad" : "good"}`;
    value.setCustomValidity(problem);
  }
  kind.addEventListener("change", validate);
  value.addEventListener("input", validate);
  validate();
  const el = h("div", {class: "rule"}, kind, value, message,
    h("button", {type: "button", class: "remove-rule", onclick: () => { el.remove(); onRemove(); }}, "Remove"), check);
  el.read = () => {
    const out = {type: kind.value};
    if (kind.value === "pattern_match") out.pattern_regex = value.value;
    else out.words = value.value.split(",").map((w) => w.trim()).filter(Boolean);
    if (message.value.trim()) out.message = message.value.trim();
    return out;
  };
  return el;
}

function side(title, rules, id) {
  const list = h("div", {class: "rules", id});
  const add = (rule = {}) => list.append(ruleRow(rule, () => {}));
  (rules || []).forEach(add);
  const el = h("fieldset", {}, h("legend", {}, title), list,
    h("button", {type: "button", class: "add-rule", onclick: () => add({type: "pattern_match"})}, "Add rule"));
  el.read = () => ({rules: [...list.children].map((r) => r.read())});
  return el;
}

export async function guardrailEditView({go, main}, id) {
  const [rail, connections] = await Promise.all([
    id ? api("GET", `/guardrails/${encodeURIComponent(id)}`) : Promise.resolve(null), api("GET", "/connections")]);
  const current = rail || {name: "", description: "", connection_ids: [], input: {rules: []}, output: {rules: []}};
  const chosen = new Set(current.connection_ids);
  const name = h("input", {name: "name", required: true, value: current.name});
  const description = h("input", {name: "description", value: current.description, size: 50});
  const conns = h("select", {name: "connections", multiple: true, size: Math.min(6, Math.max(2, connections.length))},
    connections.map((c) => h("option", {value: c.id, selected: chosen.has(c.id)}, c.name)));
  const input = side("Input rules (what people send)", current.input.rules, "input-rules");
  const output = side("Output rules (what targets answer)", current.output.rules, "output-rules");
  const messages = h("div", {class: "messages"});
  const form = h("form", {class: "card", id: "guardrail-form"},
    h("h1", {}, rail ? `Guard rail ${rail.name}` : "New guard rail"),
    field("Name", name), field("Description", description), field("Connections", conns),
    input, output,
    h("p", {class: "muted"}, "Patterns are checked as you type for their syntax and the constructs RE2 refuses; " +
      "the gateway checks them again when you save."),
    h("div", {class: "actions"}, h("button", {type: "submit", class: "primary"}, "Save"),
      rail ? h("button", {type: "button", class: "danger", onclick: remove}, "Delete") : null,
      h("a", {href: "#/guardrails"}, "Cancel")),
    messages);
  async function remove() {
    if (!confirm(`Delete guard rail ${rail.name}?`)) return;
    try {
      await api("DELETE", `/guardrails/${encodeURIComponent(rail.id)}`);
      go("/guardrails");
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  }
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = {name: name.value, description: description.value,
      connection_ids: [...conns.selectedOptions].map((o) => o.value), input: input.read(), output: output.read()};
    try {
      if (rail) await api("PUT", `/guardrails/${encodeURIComponent(rail.id)}`, {body});
      else await api("POST", "/guardrails", {body});
      go("/guardrails");
    } catch (err) {
      mount(messages, notice(err.message, "error"));
    }
  });
  mount(main, h("p", {}, h("a", {href: "#/guardrails"}, "← Guard rails")), form);
}
