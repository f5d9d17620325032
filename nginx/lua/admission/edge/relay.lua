-- admission.edge.relay: the two halves of an admitted request (issue 28, finding 5).
--
-- The public location admits the request (access.lua), then proxies it *buffered* to the relay
-- server on a unix socket (admission_http.conf): NGINX reads the relay's answer as fast as it
-- comes, whatever the client's pace, keeping what the client has not read in memory and then in
-- a temp file. The relay proxies to the node *unbuffered* (each token passes at once) and
-- queues the release in its log phase, which runs when the engine's answer has ended: a client
-- that reads slowly no longer holds the node slot and the KV booked for it. The route — the
-- ticket, the nodes to try, the lease's end — crosses in one header the relay trusts: only the
-- public location sets it (a variable, never a client header) and only NGINX's workers' group
-- can reach the relay's socket.
local cjson = require "cjson.safe"
local release = require "admission.edge.release"

local ngx = ngx
local log = ngx.log

local _M = { _VERSION = "0.1.0" }

local DELIVERY_S = 60

-- Public side, end of the access phase: what the relay needs, as the header's value.
function _M.route(ctx)
  ngx.var.admission_route = cjson.encode({ t = ctx.ticket, p = ctx.peers, u = ctx.lease_until,
                                           s = ctx.stream and true or false, e = ctx.estimate,
                                           m = ctx.model, c = ctx.class })
end

-- Relay side, access phase: the route into ngx.ctx for the balancer, usage and release.
function _M.access()
  local ctx = ngx.ctx
  local r = cjson.decode(ngx.var.http_x_admission_route or "")
  if type(r) ~= "table" or type(r.p) ~= "table" or #r.p == 0 then
    log(ngx.ERR, "admission relay: request without a route")
    return ngx.exit(500)
  end
  ctx.ticket = type(r.t) == "string" and r.t or nil
  ctx.peers = r.p
  ctx.lease_until = tonumber(r.u)
  ctx.stream = r.s == true
  ctx.estimate = type(r.e) == "number" and r.e or nil -- the edge's prompt estimate (release.lua)
  -- The model and class as the edge read them: the release names them, so that whichever
  -- sidecar takes it learns what the tenant's answers run to (scheduling/answer_lengths.py).
  ctx.model = type(r.m) == "string" and r.m or nil
  ctx.class = type(r.c) == "string" and r.c or nil
end

-- Public side, body filter: delivery is bounded too. The engine's answer ends by the lease's
-- end (the relay cuts it there); a client still reading DELIVERY_S after that is cut off (the
-- node was given back when the engine's answer ended; this frees the connection and the
-- temp file).
function _M.deliver()
  local ctx = ngx.ctx
  if ctx.lease_until and ngx.now() > ctx.lease_until + DELIVERY_S then
    if not ctx.cut then
      ctx.cut = true
      log(ngx.WARN, "admission: delivery cut off ", DELIVERY_S, " s after its lease's end")
    end
    return ngx.ERROR
  end
end

-- Public side, log phase: the relay releases every request it received (also one whose client
-- left before any status line: the relay then says whether the engine got it). One the relay
-- never received (the client left before the proxy sent it, or the relay's socket refused the
-- connection) is released here: nothing ran.
function _M.log()
  local ctx = ngx.ctx
  if not ctx.ticket then
    return
  end
  local _, last, _, header = release.upstream()
  if (not last and not release.reached()) or (last == 502 and not header) then
    release.queue({ ticket = ctx.ticket, status = 0, node_failed = false, usage = cjson.null })
  end
end

return _M
