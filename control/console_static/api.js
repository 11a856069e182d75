// The public API under /api with the signed-in user's token: the console has no power of its own.

const TOKEN_KEY = "gatewayd.console.token";

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
  /** A token handed back by the OIDC callback (/?token=...): kept, then removed from the address bar. */
  takeFromAddress() {
    const params = new URLSearchParams(location.search);
    const token = params.get("token");
    if (!token) return false;
    this.token = token;
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + (location.hash || "#/sessions"));
    return true;
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
