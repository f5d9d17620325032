-- admission.edge.admit: ask a sidecar for an admission (access phase), and wait for its answer.
-- The ask goes over the sidecars' admission sockets (admission.edge_socket: one JSON line each
-- way, pooled keepalive connections, spread over the sidecars) when `configure` named them;
-- otherwise through the internal location /_admission/admit (an HTTP subrequest to the
-- admission_sidecar upstream). The ask is held until the sidecar admits, refuses or times the
-- request out; a client that leaves meanwhile closes the connection, which cancels it.
local cjson = require "cjson.safe"
local failures = require "admission.edge.failures"

local ngx = ngx
local capture = ngx.location.capture
local HTTP_POST = ngx.HTTP_POST
local str_find = string.find
local tcp = ngx.socket.tcp

local _M = { _VERSION = "0.2.0" }

-- No sidecar answering (a connect burst, a sidecar restarting or dying while the request
-- waited in its queue) is retried for this long, with backoff, before the failure mode applies:
-- a request waits for a sidecar rather than fails.
local RETRY_FOR_S = 3
local ngx_sleep = ngx.sleep
local ngx_now = ngx.now
local math_min = math.min

local sockets = {}
local next_socket = 0
local JSON = { ["Content-Type"] = "application/json" }

-- init_worker: the sidecars' admission sockets ("unix:/path"); none: the HTTP subrequest.
function _M.configure(paths)
  sockets = {}
  for i, p in ipairs(paths or {}) do sockets[i] = "unix:" .. p end
  next_socket = ngx.worker.id() or 0 -- workers start on different sidecars
end

-- x-ratelimit-* header values from a sidecar's `ratelimit` (respond.ratelimit sets them).
local function ratelimit_header(header, rl)
  if type(rl) ~= "table" then return header end
  local h = {}
  for k, v in pairs(header) do h[k] = v end
  h.ratelimit = rl
  return h
end

local function decoded(status, body, retry_after, ratelimit)
  if status == 200 then
    if type(body) == "table" and body.ticket then
      return body
    end
    return nil, nil, "malformed sidecar answer"
  end
  local header = JSON
  if retry_after then
    header = { ["Content-Type"] = "application/json", ["Retry-After"] = tostring(retry_after) }
  end
  return nil, { status = status, header = ratelimit_header(header, ratelimit),
                body = cjson.encode(body) }
end

local function over_socket(line)
  local n = #sockets
  local tries, stale = 0, 0
  while tries < n do
    next_socket = next_socket % n + 1
    tries = tries + 1
    local path = sockets[next_socket]
    local sock, ok, cerr = nil, false, nil
    if failures.usable(path) then -- else: it refused a connect lately (failures.lua)
      sock = tcp()
      sock:settimeouts(1000, 5000, 660000) -- the read is a long poll: longer than any deadline
      ok, cerr = sock:connect(path)
      if ok then
        failures.connected("the admission socket", path)
      else
        failures.connect_failed("the admission socket", path, cerr)
      end
    end
    if ok then
      local got = sock:send(line) and sock:receive("*l")
      if got then
        local a = cjson.decode(got)
        if type(a) ~= "table" or type(a.status) ~= "number" then
          sock:close()
          return nil, nil, "malformed sidecar answer"
        end
        -- Read: say so (the ask carried ack = true). Until this line arrives, the sidecar
        -- gives the lease back if the connection closes (the request was aborted meanwhile).
        if a.status == 200 and not sock:send("+\n") then
          sock:close()
          return nil, nil, "sidecar connection lost"
        end
        sock:setkeepalive(75000, 1024)
        return decoded(a.status, a.body, a.retry_after, a.ratelimit)
      end
      local reused = sock:getreusedtimes()
      sock:close()
      if reused > 0 and stale < 64 then
        -- A pooled connection its sidecar had closed (it restarted): try a fresh one now.
        -- Re-asking is safe either way: the sidecar keys the charge on the request id.
        stale, tries = stale + 1, tries - 1
      else
        -- The sidecar took the ask and died (or closed) before answering: asked again by
        -- ask()'s retry, at whichever sidecar answers, with the request's arrival time.
        return nil, nil, "sidecar connection lost"
      end
    end
  end
  return nil, nil, "no sidecar socket accepted a connection"
end

local function over_http(body)
  local res = capture("/_admission/admit", { method = HTTP_POST, body = body })
  if res.status == 200 then
    return decoded(200, cjson.decode(res.body))
  end
  local ctype = res.header["Content-Type"] or ""
  if res.status >= 400 and res.status < 600 and res.status ~= 502 and res.status ~= 504
     and str_find(ctype, "application/json", 1, true) then
    return nil, res
  end
  return nil, nil, "sidecar unavailable (status " .. res.status .. ")"
end

local function once(body)
  if #sockets > 0 then
    return over_socket(body .. "\n")
  end
  return over_http(body)
end

-- Returns decision table (200), or nil, res (a sidecar answer to pass on), or nil, nil, err
-- when no sidecar answered within RETRY_FOR_S of the first failure. The window starts at the
-- failure, not at the ask: a request that waited 8 s in a sidecar's queue when that sidecar died
-- is still re-asked (with its arrival time, so it keeps its turn).
function _M.ask(req)
  req.ack = #sockets > 0 or nil -- the socket protocol's acknowledgement (edge_socket)
  local body = cjson.encode(req)
  local deadline
  local delay = 0.01
  while true do
    local d, res, err = once(body)
    if d or res then
      return d, res, err
    end
    if not req.reask then
      -- Asked again from now on: a sidecar that took the ask and died may have leased a node
      -- for it; the one that admits it now gives any other lease of this request back.
      req.reask = true
      body = cjson.encode(req)
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
