-- admission.edge.release: report ticket, status and usage to a sidecar after the engine's
-- response (the relay server's log phase: admission.edge.relay). The log phase cannot use sockets, so the release is queued in a shared dict
-- and delivered by a few drainer timers per worker, in batches (one POST of a JSON array)
-- over keepalive unix-socket connections to the sidecars.
--
-- Nothing is dropped on a sidecar stall or a burst: a batch that no sidecar takes goes back
-- to the head of the queue, and a periodic timer retries; the queue lives in shared memory,
-- so it survives `nginx -s reload` (new workers drain what old ones left). Only a full queue
-- (lua_shared_dict admission_releases) loses a release — logged — and even then leases and
-- reservations expire on their own.
local cjson = require "cjson.safe"
local failures = require "admission.edge.failures"
local usage = require "admission.edge.usage"

local ngx = ngx
local log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN
local timer_at = ngx.timer.at
local tcp = ngx.socket.tcp
local concat = table.concat
local str_match = string.match
local str_lower = string.lower
local tonumber = tonumber

local _M = { _VERSION = "0.2.0" }

local QUEUE = "q"
local BATCH = 64          -- releases per POST (the sidecar takes up to 256)
local DRAINERS = 4        -- concurrent drainer timers per worker
local RETRY_S = 0.5       -- period of the retry timer for batches no sidecar took

local sockets = {}
local next_socket = 0
local draining = 0        -- drainer timers running in this worker
local dict

-- POST one batch: "ok" when a sidecar took it (2xx, or 400: malformed, retrying won't help),
-- "refused" when a sidecar answered it otherwise (5xx: something in it it cannot settle now),
-- "down" when no sidecar answered at all.
local function post(body)
  local n = #sockets
  local answered = false
  for i = 1, n do
    next_socket = next_socket % n + 1 -- spread batches over the sidecars
    local path = sockets[next_socket]
    local sock, ok, cerr = nil, false, nil
    if failures.usable(path) then -- else: it refused a connect lately (failures.lua)
      sock = tcp()
      sock:settimeouts(200, 2000, 5000)
      ok, cerr = sock:connect("unix:" .. path)
      if ok then
        failures.connected("the release socket", path)
      else
        failures.connect_failed("the release socket", path, cerr)
      end
    end
    if ok then
      local req = "POST /release HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        .. "Content-Length: " .. #body .. "\r\n\r\n" .. body
      local line = sock:send(req) and sock:receive("*l")
      local status = line and tonumber(str_match(line, "^HTTP/%d%.%d (%d%d%d)"))
      local len
      while status do
        local h = sock:receive("*l")
        if not h then status = nil break end
        if h == "" then break end
        local v = str_match(str_lower(h), "^content%-length:%s*(%d+)")
        if v then len = tonumber(v) end
      end
      if status and len and len > 0 and not sock:receive(len) then status = nil end
      if status and status < 300 then
        sock:setkeepalive(60000, 64)
        return "ok"
      end
      sock:close()
      if status == 400 then
        log(ERR, "admission release batch refused as malformed; dropped")
        return "ok"
      end
      answered = answered or status ~= nil
    end
  end
  return answered and "refused" or "down"
end

-- A batch the sidecars answered but did not take: each release goes alone, so that one they
-- cannot settle does not hold the others back (head of line, resent forever). One refused on
-- its own is set aside, logged: its lease waits out its TTL, charged as booked.
local function post_each(items)
  for i, item in ipairs(items) do
    local got = post("[" .. item .. "]")
    if got == "down" then
      return i -- the sidecars went away: this one and the rest go back to the queue
    end
    if got == "refused" then
      log(ERR, "admission release refused by the sidecars on its own; set aside (its lease ",
          "expires): ", string.sub(item, 1, 200))
    end
  end
  return nil
end

local function drain(premature)
  if not premature then
    local ok, err = pcall(function()
      while true do
        local items = {}
        for _ = 1, BATCH do
          local v = dict:lpop(QUEUE)
          if not v then break end
          items[#items + 1] = v
        end
        if #items == 0 then return end
        local got = post("[" .. concat(items, ",") .. "]")
        local back = got == "down" and 1 or (got == "refused" and post_each(items)) or nil
        if back then
          for i = #items, back, -1 do dict:lpush(QUEUE, items[i]) end -- back, in order
          log(WARN, "admission releases not delivered (no sidecar answered); ",
              #items - back + 1, " queued for retry")
          return
        end
      end
    end)
    if not ok then log(ERR, "admission release drainer failed: ", err) end
  end
  draining = draining - 1
end

local function kick()
  if draining >= DRAINERS then return end
  draining = draining + 1
  local ok, err = timer_at(0, drain)
  if not ok then
    draining = draining - 1 -- the release stays queued: the retry timer takes it
    log(WARN, "admission release drainer not started: ", err)
  end
end

-- init_worker: the sidecars' sockets, and the retry timer.
function _M.configure(socket_paths)
  sockets = socket_paths
  dict = ngx.shared.admission_releases
  ngx.timer.every(RETRY_S, function(premature)
    if not premature and dict:llen(QUEUE) > 0 then kick() end
  end)
end

-- What NGINX's upstream variables say of the peers tried: upstream_status lists every one
-- ("502, 200" after a fallback), the last is the answer; header times are "-" for a peer that
-- never sent its status line. Returns first status, last status, first header time, last
-- header time (nil where absent).
function _M.upstream()
  local v = ngx.var
  local statuses = v.upstream_status or ""
  local headers = v.upstream_header_time or ""
  return tonumber(str_match(statuses, "^%s*(%d+)")), tonumber(str_match(statuses, "(%d+)%s*$")),
         tonumber(str_match(headers, "^%s*([%d.]+)")), tonumber(str_match(headers, "([%d.]+)%s*$"))
end

-- Whether the request reached a peer: NGINX sent it bytes (upstream_bytes_sent lists every
-- peer tried, "0, 1187" after a fallback). An engine that received a request may have
-- prefilled and decoded it, whether or not it sent a status line before the client left.
function _M.reached()
  for n in string.gmatch(ngx.var.upstream_bytes_sent or "", "%d+") do
    if tonumber(n) > 0 then return true end
  end
  return false
end

function _M.log()
  local ctx = ngx.ctx
  if not ctx.ticket then
    return
  end
  -- The first peer is the node the ticket names: it could not be reached when it gave 502
  -- without sending a response header (connect refused or timed out, or closed unanswered) —
  -- not on a 502 NGINX gives for what a live engine sent ("upstream sent too big header").
  local first, last, first_header, last_header = _M.upstream()
  -- No upstream status: either no engine received the request (the client left before the
  -- proxy sent it): 0, nothing ran; or the engine received it and the client left before its
  -- status line (a non-streamed answer's comes only when generation ends): 499, the engine
  -- worked until the abort, charged as booked — one rule whether streamed or not.
  -- header_s: how long the last engine took to answer its status line (nil: it never did).
  -- The sidecar believes a quick 4xx did no work, not a slow one (admission/usage.py).
  local status = last or (_M.reached() and 499 or 0)
  local used, finish = usage.extract(ctx)
  _M.queue({ ticket = ctx.ticket, status = status,
             node_failed = first == 502 and not first_header,
             header_s = last_header, estimate = ctx.estimate, model = ctx.model,
             class = ctx.class, usage = used or cjson.null, finish = finish })
end

-- Queue one release for the drainers (any phase).
function _M.queue(release)
  local len, err = dict:rpush(QUEUE, cjson.encode(release))
  if not len then
    log(ERR, "admission release queue full (", err, "); the lease will expire")
    return
  end
  kick()
end

return _M
