-- admission.edge.respond: the one place an edge failure becomes an HTTP answer.
-- Any phase before the response is sent. OpenAI-shaped JSON: {"error": {message, type, code}}.
local cjson = require "cjson.safe"

local ngx = ngx
local ngx_say = ngx.say
local ngx_exit = ngx.exit

local _M = { _VERSION = "0.1.0" }

local TYPES = {
  [400] = "invalid_request_error", [401] = "authentication_error", [403] = "permission_error",
  [404] = "invalid_request_error", [413] = "invalid_request_error", [429] = "rate_limit_exceeded",
  [503] = "service_unavailable",
}

-- As OpenAI writes a reset: 20ms, 1.5s, 6m0s (admission/answer.py's duration, the same).
local function duration(s)
  if s < 1 then
    return string.format("%dms", math.max(0, math.floor(s * 1000 + 0.5)))
  end
  if s < 60 then
    return (string.format("%.1f", s):gsub("%.0$", "")) .. "s"
  end
  return string.format("%dm%ds", math.floor(s / 60), math.floor(s % 60))
end

-- OpenAI's x-ratelimit-* headers from a sidecar's `ratelimit` (the tenant's request and token
-- buckets as the admission saw them: capacity, what is left, time until full).
function _M.ratelimit(rl)
  if type(rl) ~= "table" then return end
  for _, kind in ipairs({ "requests", "tokens" }) do
    if type(rl[kind]) == "number" then
      ngx.header["x-ratelimit-limit-" .. kind] = tostring(math.floor(rl[kind]))
    end
    local left, reset = rl[kind .. "_remaining"], rl[kind .. "_reset_s"]
    if type(left) == "number" and type(reset) == "number" then
      ngx.header["x-ratelimit-remaining-" .. kind] = tostring(math.floor(left))
      ngx.header["x-ratelimit-reset-" .. kind] = duration(reset)
    end
  end
end

-- Every answer names NGINX's request id: the id the charge is keyed on, the engine's request id.
local function request_id()
  ngx.header["X-Request-Id"] = ngx.var.request_id
end

function _M.error(status, code, message, retry_after)
  ngx.status = status
  request_id()
  ngx.header["Content-Type"] = "application/json"
  if retry_after then
    ngx.header["Retry-After"] = tostring(retry_after)
  end
  ngx_say(cjson.encode({ error = { message = message, type = TYPES[status] or "server_error",
                                   code = code } }))
  return ngx_exit(status)
end

-- A path the edge does not serve (admission_locations.conf): 404 as OpenAI answers one, so an
-- engine endpoint the edge does not admit and charge never reaches an engine.
-- The message names what this edge does serve, as the policy has it (edge.admit_embeddings,
-- edge.passthrough).
function _M.not_served()
  local t = require("admission.edge.table").get() or {}
  local paths = { "/v1/chat/completions", "/v1/completions" }
  if t.admit_embeddings then paths[#paths + 1] = "/v1/embeddings" end
  paths[#paths + 1] = "/v1/models"
  local more = {}
  for p in pairs(type(t.passthrough) == "table" and t.passthrough or {}) do more[#more + 1] = p end
  table.sort(more)
  for _, p in ipairs(more) do paths[#paths + 1] = p end
  return _M.error(404, "unknown_url", "Unknown request URL: " .. ngx.req.get_method() .. " "
                  .. ngx.var.uri .. ". This edge serves " .. table.concat(paths, ", ")
                  .. ", /v1/files and /v1/batches.")
end

-- A request identify.tenant() could not attribute. Without an edge table (the sidecars have not
-- written one yet, or it is unreadable) no key can be checked: that is our outage, not the
-- client's bad key, so 503 with Retry-After rather than 401.
function _M.unidentified(reason)
  if reason == "edge_table_missing" then
    return _M.error(503, "admission_unavailable", "tenant table not loaded yet", 1)
  end
  return _M.error(401, reason == "missing_api_key" and "missing_api_key" or "invalid_api_key",
                  "missing or unknown API key")
end

-- Pass a sidecar error answer through unchanged (it is already in OpenAI's shape).
function _M.passthrough(res)
  ngx.status = res.status
  request_id()
  local header = res.header or {}
  for name, value in pairs(header) do -- the HTTP route's own x-ratelimit-* headers
    if type(value) == "string" and string.find(string.lower(name), "^x%-ratelimit%-") then
      ngx.header[name] = value
    end
  end
  _M.ratelimit(header.ratelimit) -- the admission socket's, as figures
  ngx.header["Content-Type"] = "application/json"
  local ra = res.header and res.header["Retry-After"]
  if ra then
    ngx.header["Retry-After"] = ra
  end
  ngx.print(res.body)
  return ngx_exit(res.status)
end

-- NGINX's own 413 and 502/503/504 pages (a body too large; every node failed to connect, or a
-- node died or timed out before its first byte) become OpenAI-shaped JSON, like every other
-- answer the edge gives. An engine's own 5xx (it sent a Content-Type) passes through unchanged.
local ENGINE_ERRORS = {
  [413] = { "body_too_large", "request body too large" },
  [502] = { "engine_unavailable", "the inference node failed before answering; retry" },
  [503] = { "engine_unavailable", "the inference node refused the request; retry" },
  [504] = { "engine_timeout", "the inference node did not answer in time" },
}

function _M.header_filter()
  request_id()
  _M.ratelimit(ngx.ctx.ratelimit)
  _M.engine_errors()
end

-- The shaping alone (the relay server's header filter: the public side adds the rest).
function _M.engine_errors()
  local e = ENGINE_ERRORS[ngx.status]
  if not e or ngx.var.upstream_http_content_type then
    return
  end
  local ctype = ngx.header["Content-Type"]
  if ctype and ctype:find("application/json", 1, true) then
    return -- ours (respond.error) or already JSON
  end
  ngx.ctx.own_error = cjson.encode({ error = { message = e[2], code = e[1],
    type = ngx.status == 413 and "invalid_request_error" or "server_error" } }) .. "\n"
  ngx.header["Content-Type"] = "application/json"
  ngx.header["Content-Length"] = nil
  if ngx.status ~= 413 then
    ngx.header["Retry-After"] = "1"
  end
end

-- true when the body was replaced (the other body filters then have nothing to see).
function _M.body_filter()
  local ctx = ngx.ctx
  local own = ctx.own_error
  if not own then
    return false
  end
  ngx.arg[1] = own
  ctx.own_error = ""
  return true
end

return _M
