// The public API under /api with the signed-in user's token: the console has no power of its own.

const TOKEN_KEY = "gatewayd.console.token";
const LOGIN_KEY = "gatewayd.console.login";  // the sign-in this tab started (sessionStorage: this tab only)

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const auth = {
  get token() { return localStorage.getItem(TOKEN_KEY); },
  set token(value) {
    if (value) localStorage.setItem(TOKEN_KEY, value);
    else localStorage.removeItem(TOKEN_KEY);
  },
  /** Where a single sign-on started here should come back to: the page, with a fresh random ``login`` value
   * that only this tab knows (kept until the callback brings it back). */
  startLogin() {
    const nonce = Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, "0"))
      .join("");
    sessionStorage.setItem(LOGIN_KEY, nonce);
    return `/?login=${nonce}`;
  },
  /** A token handed back by the OIDC callback (/?login=...&token=...): kept only when it answers the sign-in
   * this tab started, so a link carrying someone else's token never signs anyone in or replaces the signed-in
   * user. Either way it is taken out of the address bar. "taken", "ignored", or "" when there was none. */
  takeFromAddress() {
    const params = new URLSearchParams(location.search);
    const token = params.get("token");
    const login = params.get("login");
    const expected = sessionStorage.getItem(LOGIN_KEY);
    if (login && login === expected) sessionStorage.removeItem(LOGIN_KEY);
    if (!token) return "";
    const ours = Boolean(login && expected && login === expected);
    if (ours) this.token = token;
    params.delete("token");
    params.delete("login");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + (location.hash || "#/sessions"));
    return ours ? "taken" : "ignored";
  },
};

let onUnauthorized = () => {};
/** What to do when the API says the token is no longer good (401). */
export function whenSignedOut(callback) { onUnauthorized = callback; }

/** One call: the decoded JSON (or text, or Blob with ``as: "blob"``); ApiError with the API's message. */
export async function api(method, path, {body, query, as} = {}) {
  const url = new URL(`/api${path}`, location.origin);
  for (const [key, value] of Object.entries(query || {})) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, value);
  }
  const headers = {};
  if (auth.token) headers.Authorization = `Bearer ${auth.token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(url, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  } catch (error) {
    throw new ApiError(0, `cannot reach the gateway (${error.message})`);
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try { message = (await response.json()).message || message; } catch { /* not JSON */ }
    if (response.status === 401 && auth.token && !path.startsWith("/localauth")) onUnauthorized(message);
    throw new ApiError(response.status, message);
  }
  if (as === "blob") return {status: response.status, body: await response.blob()};
  const text = await response.text();
  const type = response.headers.get("Content-Type") || "";
  const data = text && type.includes("json") ? JSON.parse(text) : text;
  return as === "full" ? {status: response.status, body: data} : data;
}

/** Follow a server-sent event stream of the API (``GET /api<path>``) with the token: ``onEvent(name, data)`` for
 * each event as it comes. A dropped stream is taken up again after the last event seen (``Last-Event-ID``) until an
 * ``end`` event arrives or ``signal`` aborts. Resolves when it ended; rejects with ApiError when it is refused. */
export async function follow(path, onEvent, {signal} = {}) {
  let last = null;
  for (let attempt = 0; ; attempt++) {
    const headers = {Accept: "text/event-stream"};
    if (auth.token) headers.Authorization = `Bearer ${auth.token}`;
    if (last !== null) headers["Last-Event-ID"] = last;
    let response;
    try {
      response = await fetch(new URL(`/api${path}`, location.origin), {headers, signal});
    } catch (error) {
      if (signal && signal.aborted) return;
      if (attempt > 30) throw new ApiError(0, `cannot reach the gateway (${error.message})`);
      await new Promise((done) => setTimeout(done, 1000));
      continue;
    }
    if (!response.ok) {
      let message = `${response.status} ${response.statusText}`;
      try { message = (await response.json()).message || message; } catch { /* not JSON */ }
      if (response.status === 401 && auth.token) onUnauthorized(message);
      throw new ApiError(response.status, message);
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buffer += value;
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          let name = "message";
          const data = [];
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) name = line.slice(6).trim();
            else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
            else if (line.startsWith("id:")) last = line.slice(3).trim();
          }
          if (!data.length) continue;
          onEvent(name, JSON.parse(data.join("\n")));
          if (name === "end") return;
        }
      }
    } catch (error) {
      if (signal && signal.aborted) return;
    }
    if (signal && signal.aborted) return;
    await new Promise((done) => setTimeout(done, 500));  // dropped before its end: take it up again
  }
}

let protocolsAsked = null;

/** The gateway's protocols (``GET /api/protocols``), asked once per page load: by subtype, what each one is called,
 * how its recordings are shown (``presentation``) and what they export to. The console names no protocol itself. */
export function protocols() {
  protocolsAsked = protocolsAsked || api("GET", "/protocols")
    .then((list) => new Map(list.map((p) => [p.subtype, p])))
    .catch((err) => { protocolsAsked = null; throw err; });
  return protocolsAsked;
}
