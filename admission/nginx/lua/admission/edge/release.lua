-- admission.edge.release: report ticket, status and usage to a sidecar after the response
-- (log phase). The log phase cannot use sockets, so a zero-delay timer does the POST over the
-- sidecars' unix sockets (first one that answers), reusing connections from a keepalive pool.
-- A lost release leaks nothing: leases and reservations expire on their own.
local cjson = require "cjson.safe"
local usage = require "admission.edge.usage"

local ngx = ngx
local log = ngx.log
local WARN = ngx.WARN

local _M = { _VERSION = "0.1.0" }

local sockets = {}

function _M.configure(socket_paths)
  sockets = socket_paths
end

local function post(premature, body)
  if premature then return end
  for _, path in ipairs(sockets) do
    local sock = ngx.socket.tcp()
    sock:settimeouts(200, 1000, 2000)
    local ok = sock:connect("unix:" .. path)
    if ok then
      local req = "POST /release HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        .. "Content-Length: " .. #body .. "\r\n\r\n" .. body
      local sent = sock:send(req)
      local line = sent and sock:receive("*l")
      if line then
        local len
        while true do
          local h = sock:receive("*l")
          if not h or h == "" then break end
          local n = h:lower():match("^content%-length:%s*(%d+)")
          if n then len = tonumber(n) end
        end
        if len and len > 0 then sock:receive(len) end
        sock:setkeepalive(10000, 16)
        return
      end
      sock:close()
    end
  end
  log(WARN, "admission release not delivered (no sidecar answered); the lease will expire")
end

function _M.log()
  local ctx = ngx.ctx
  if not ctx.ticket then
    return
  end
  local status = tonumber(ngx.var.upstream_status) or ngx.status or 0
  local body = cjson.encode({ ticket = ctx.ticket, status = status,
                              usage = usage.extract(ctx) or cjson.null })
  ngx.timer.at(0, post, body)
end

return _M
