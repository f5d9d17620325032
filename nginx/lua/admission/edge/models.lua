-- admission.edge.models: GET /v1/models from the policy, without a backend call (content phase).
local cjson = require "cjson.safe"
local identify = require "admission.edge.identify"
local respond = require "admission.edge.respond"

local ngx = ngx

local _M = { _VERSION = "0.1.0" }

function _M.serve()
  identify.strip_internal_headers()
  local tid, tenant = identify.tenant()
  if not tid then
    return respond.unidentified(tenant)
  end
  local data = {}
  for i, m in ipairs(tenant.models or {}) do
    data[i] = { id = m, object = "model", owned_by = "admission" }
  end
  ngx.header["Content-Type"] = "application/json"
  ngx.header["X-Request-Id"] = ngx.var.request_id
  ngx.say(cjson.encode({ object = "list", data = data }))
end

return _M
