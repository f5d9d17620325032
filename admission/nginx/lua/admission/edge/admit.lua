-- admission.edge.admit: ask the sidecar (access phase) through the internal location
-- /_admission/admit (unix-socket upstream with keepalive; several sidecar processes behind it).
-- The subrequest is held until the sidecar admits, refuses or times the request out.
local cjson = require "cjson.safe"

local ngx = ngx
local capture = ngx.location.capture
local HTTP_POST = ngx.HTTP_POST
local str_find = string.find

local _M = { _VERSION = "0.1.0" }

-- No sidecar answering (a connect burst, a sidecar restarting or dying while the request
-- waited in its queue) is retried for this long, with backoff, before the failure mode applies:
-- a request waits for a sidecar rather than fails.
local RETRY_FOR_S = 3
local ngx_sleep = ngx.sleep
local ngx_now = ngx.now
local math_min = math.min

local function once(body)
  local res = capture("/_admission/admit", { method = HTTP_POST, body = body })
  if res.status == 200 then
    local d = cjson.decode(res.body)
    if type(d) == "table" and d.ticket then
      return d
    end
    return nil, nil, "malformed sidecar answer"
  end
  local ctype = res.header["Content-Type"] or ""
  if res.status >= 400 and res.status < 600 and res.status ~= 502 and res.status ~= 504
     and str_find(ctype, "application/json", 1, true) then
    return nil, res
  end
  return nil, nil, "sidecar unavailable (status " .. res.status .. ")"
end

-- Returns decision table (200), or nil, res (a sidecar answer to pass on), or nil, nil, err
-- when no sidecar answered within RETRY_FOR_S of the first failure. The window starts at the
-- failure, not at the ask: a request that waited 8 s in a sidecar's queue when that sidecar died
-- is still re-asked (with its arrival time, so it keeps its turn).
function _M.ask(req)
  local body = cjson.encode(req)
  local deadline
  local delay = 0.01
  while true do
    local d, res, err = once(body)
    if d or res then
      return d, res, err
    end
    deadline = deadline or ngx_now() + RETRY_FOR_S
    if ngx_now() >= deadline then
      return d, res, err
    end
    ngx_sleep(delay)
    delay = math_min(delay * 2, 0.25)
  end
end

return _M
