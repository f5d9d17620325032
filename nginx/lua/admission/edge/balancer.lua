-- admission.edge.balancer: proxy to the node the sidecar chose (balancer phase); on a connect
-- failure move to the next fallback. proxy_next_upstream only retries before anything was sent
-- upstream for a POST, so nothing is retried after the first byte.
local balancer = require "ngx.balancer"

local ngx = ngx
local str_match = string.match

local _M = { _VERSION = "0.1.0" }

local function host_port(url)
  local host, port = str_match(url, "^https?://([^:/]+):?(%d*)")
  return host, tonumber(port) or 80
end

function _M.balance()
  local ctx = ngx.ctx
  local peers = ctx.peers
  if not peers then
    return ngx.exit(500)
  end
  local i = (ctx.peer_index or 0) + 1
  ctx.peer_index = i
  if i == 1 and #peers > 1 then
    balancer.set_more_tries(#peers - 1)
  end
  local peer = peers[i] or peers[#peers]
  local host, port = host_port(peer.url)
  ctx.node = peer.node
  if ctx.lease_until then
    -- Waiting for the engine ends with the lease: after it, the slot may be someone else's.
    local left = ctx.lease_until - ngx.now()
    balancer.set_timeouts(2, 60, math.max(0.001, math.min(600, left)))
  end
  local ok, err = balancer.set_current_peer(host, port)
  if not ok then
    ngx.log(ngx.ERR, "set_current_peer failed: ", err)
    return ngx.exit(500)
  end
end

return _M
