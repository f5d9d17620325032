-- admission.edge.admit: ask the sidecar (access phase) through the internal location
-- /_admission/admit (unix-socket upstream with keepalive; several sidecar processes behind it).
-- The subrequest is held until the sidecar admits, refuses or times the request out.
local cjson = require "cjson.safe"

local ngx = ngx
local capture = ngx.location.capture
local HTTP_POST = ngx.HTTP_POST
local str_find = string.find

local _M = { _VERSION = "0.1.0" }

-- Returns decision table (200), or nil, res (a sidecar answer to pass on), or nil, nil, err
-- when no sidecar answered at all.
function _M.ask(req)
  local res = capture("/_admission/admit", { method = HTTP_POST, body = cjson.encode(req) })
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

return _M
