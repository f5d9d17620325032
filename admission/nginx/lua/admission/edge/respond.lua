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

function _M.error(status, code, message, retry_after)
  ngx.status = status
  ngx.header["Content-Type"] = "application/json"
  if retry_after then
    ngx.header["Retry-After"] = tostring(retry_after)
  end
  ngx_say(cjson.encode({ error = { message = message, type = TYPES[status] or "server_error",
                                   code = code } }))
  return ngx_exit(status)
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
  ngx.header["Content-Type"] = "application/json"
  local ra = res.header and res.header["Retry-After"]
  if ra then
    ngx.header["Retry-After"] = ra
  end
  ngx.print(res.body)
  return ngx_exit(res.status)
end

return _M
