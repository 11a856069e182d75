// Guard rails: the list, and a form to create or edit one, its regular expressions checked as you type.
import {api} from "./api.js";
import {h, mount, notice, select, field} from "./dom.js";

// Each rule type the editor knows, and the sides it belongs to (the API says which side takes which).
const KINDS = [["deny_words_list", "deny words"], ["pattern_match", "pattern (regex)"],
  ["statement_kinds", "deny statement kinds (PostgreSQL)"], ["require_where", "require WHERE (PostgreSQL)"],
  ["mask", "mask"]];
const SIDES = {input: ["deny_words_list", "pattern_match", "statement_kinds", "require_where"],
  output: ["deny_words_list", "pattern_match", "mask"]};
const MASK_STYLES = [["fixed", "****"], ["last4", "keep the last four"], ["hash", "stable hash"]];
const list = (text) => text.split(",").map((w) => w.trim()).filter(Boolean);

export async function guardrailsView({me, main}) {
  const [rails, connections] = await Promise.all([api("GET", "/guardrails"), api("GET", "/connections")]);
  const names = new Map(connections.map((c) => [c.id, c.name]));
  const count = (side) => (side && side.rules ? side.rules.length : 0);
  mount(main, h("h1", {}, "Guard rails"),
    me.is_admin ? h("p", {}, h("a", {href: "#/guardrails/new", class: "button primary", id: "new-guardrail"},
      "New guard rail")) : null,
h("div", {class: "scroll"}, h("table", {class: "grid", id: "guardrails"},
      h("thead", {}, h("tr", {}, ["Name", "Description", "Connections", "Input rules", "Output rules"]
        .map((t) => h("th", {}, t)))),
      h("tbody", {}, rails.length ? rails.map((r) => h("tr", {dataset: {guardrail: r.name}},
        h("td", {}, me.is_admin ? h("a", {href: `#/guardrails/${encodeURIComponent(r.id)}`}, r.name) : r.name),
        h("td", {}, r.description),
        h("td", {}, r.connection_ids.map((id) => names.get(id) || id).join(", ")),
        h("td", {}, String(count(r.input))), h("td", {}, String(count(r.output))))) :
        h("tr", {}, h("td", {colspan: 5, class: "muted"}, "No guard rails."))))));
}

/** Why ``pattern`` would be refused, or "": asked of the gateway, whose RE2 checks it as a save does (a browser's
 * own regular expressions differ: no inline flags like (?i), look-arounds RE2 lacks). */
export async function patternProblem(pattern) {
  if (!pattern) return "a pattern is required";
  const answer = await api("GET", "/guardrails/patterns/check", {query: {pattern}});
  return answer.valid ? "" : answer.message;
}

/** One rule's row: its kind (those of its side) and that kind's fields, read back as the API takes them. */
function ruleRow(rule, sideName) {
  const kinds = KINDS.filter(([k]) => SIDES[sideName].includes(k));
  const kind = select("type", kinds, rule.type || "deny_words_list", {class: "rule-type"});
  const initial = {deny_words_list: (rule.words || []).join(", "), pattern_match: rule.pattern_regex || "",
    statement_kinds: (rule.deny || []).join(", "), require_where: (rule.statements || []).join(", "),
    mask: rule.pattern_regex || ""};
  const value = h("input", {class: "rule-value", size: 40, value: initial[kind.value] || ""});
  const patterns = h("input", {class: "mask-patterns", size: 24, placeholder: "built-in: email, card_number, iban…",
    value: (rule.patterns || []).join(", ")});
  const columns = h("input", {class: "mask-columns", size: 20, placeholder: "columns or JSON keys",
    value: (rule.columns || []).join(", ")});
  const style = select("style", MASK_STYLES, rule.style || "fixed", {class: "mask-style"});
  const clear = h("input", {type: "checkbox", class: "mask-record-clear", checked: !!rule.record_clear});
  const maskFields = h("span", {class: "mask-fields"}, patterns, columns, style,
    h("label", {title: "also record the clear text, sealed, for admins"}, clear, " record clear"));
  const message = h("input", {class: "rule-message", placeholder: "message (optional)", value: rule.message || ""});
  const check = h("span", {class: "rule-check", role: "status"});
  const placeholders = {deny_words_list: "words, comma separated", pattern_match: "regular expression (RE2 syntax)",
    statement_kinds: "DropStmt, TruncateStmt, GrantStmt…", require_where: "delete, update",
    mask: "regular expression (optional)"};
  let asked = 0;  // the newest check asked: an older answer that comes late is dropped
  async function validate() {
    const regex = kind.value === "pattern_match" || (kind.value === "mask" && value.value);
    value.placeholder = placeholders[kind.value];
    maskFields.hidden = kind.value !== "mask";
    message.hidden = kind.value === "mask";  // a mask answers nothing: the result flows on
    const mine = ++asked;
    let problem = "";
    if (regex) {
      check.textContent = "… checking";
      check.className = "rule-check";
      value.setCustomValidity("checking");
      try {
        problem = await patternProblem(value.value);
      } catch (err) {
        problem = `could not be checked (${err.message})`;
      }
      if (mine !== asked) return;
    } else if (kind.value === "mask" && !list(patterns.value).length && !list(columns.value).length) {
      problem = "a mask needs built-in patterns, a regular expression or columns";
    }
    check.textContent = problem ? `✗ ${problem}` : regex ? "✓ valid syntax" : "";
    check.className = `rule-check ${problem ? "bad" : regex ? "good" : ""}`;
    value.setCustomValidity(problem);
  }
  for (const control of [kind, value, patterns, columns]) control.addEventListener("input", validate);
  kind.addEventListener("change", validate);
  validate();
  const el = h("div", {class: "rule"}, kind, value, maskFields, message,
    h("button", {type: "button", class: "remove-rule", onclick: () => el.remove()}, "Remove"), check);
  el.read = () => {
    const out = {type: kind.value};
    if (kind.value === "pattern_match") out.pattern_regex = value.value;
    else if (kind.value === "deny_words_list") out.words = list(value.value);
    else if (kind.value === "statement_kinds") out.deny = list(value.value);
    else if (kind.value === "require_where") out.statements = list(value.value);
    else {
      if (list(patterns.value).length) out.patterns = list(patterns.value);
      if (value.value) out.pattern_regex = value.value;
      if (list(columns.value).length) out.columns = list(columns.value);
      out.style = style.value;
      if (clear.checked) out.record_clear = true;
      return out;
    }
    if (message.value.trim()) out.message = message.value.trim();
    return out;
  };
  return el;
}

function side(title, rules, id, sideName) {
  const rows = h("div", {class: "rules", id});
  const add = (rule = {}) => rows.append(ruleRow(rule, sideName));
  (rules || []).forEach(add);
  const el = h("fieldset", {}, h("legend", {}, title), rows,
    h("button", {type: "button", class: "add-rule", onclick: () => add({type: "pattern_match"})}, "Add rule"));
  el.read = () => ({rules: [...rows.children].map((r) => r.read())});
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
  const input = side("Input rules (what people send)", current.input.rules, "input-rules", "input");
  const output = side("Output rules (what targets answer)", current.output.rules, "output-rules", "output");
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
